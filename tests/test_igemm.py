"""igemm: the integer-activation grouped GEMM (Numba) against its NumPy spec (``toolkit/ref/igemm.py``): numba's
own parts. The op itself on every backend (default kernel choice, shape tables, Mixtral's shapes) runs in
tests/test_ops_moe.py; here both kernels forced over the same cases, the activation quantizer, the spec against
the formats and the f32 path, the drop-in entries and the assembly.

Tolerances: activation quantization bit-identical; the integer parts exact: with power-of-two scales
every step of both sides is exact in f32, so the kernel must equal the reference bit for bit (a wrong
code, offset, block or group shows); with real scales within the spec's bound ``error_bound`` (a recursive
f32 sum of B + G terms: (B + G + 4) * 2^-23 * sum of |terms|). Plus the spec against the f32 path on
dequantized activations, and the assembly: the inner loop holds the host's wide integer multiply-adds.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import assert_close
from toolkit.cpu import igemm
from test_ops_moe import IGEMM_CASES, IGEMM_REAL, IGEMM_SPECS, case_id, igemm_case, quantized, segments
from toolkit.cpu.igemm_simd import isa
from toolkit.formats import get_format
from toolkit.ops import get_op
from toolkit.ref import igemm as ref

RNG = np.random.default_rng(19)
# the op against its spec on every backend (formats, shape tables, the default kernel choice): tests/test_ops_moe.py;
# here numba's two kernels forced (path "gemm": the register tile, "gemv": the one-row kernel), which get_op's
# common signature does not name
PATHS = ["gemm", "gemv"]


def run_kernel(w, codes, scales, seg_e, seg_lo, seg_hi, path):
    return get_op("igemm", "numba")(codes, scales, w, seg_e, seg_lo, seg_hi, path=path)


# ---- activations ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (3, 4096)])
def test_quantize_act(shape):
    x = RNG.standard_normal(shape).astype(np.float32) * np.float32(3)
    x[0, :32] = 0  # an all-zero block: scale 0, codes 0
    if shape[1] >= 64:  # ties: x * inv lands on k + 0.5 exactly (absmax 127 -> d = 1, inv = 1)
        x[-1, 32:64] = np.float32(0.5) + np.arange(32, dtype=np.float32) - 16
        x[-1, 63] = 127
    codes, scales = ref.quantize_act(x)
    act = igemm.quantize_act(x)
    assert_close(act.codes[:-1], codes, exact=True, what="codes")
    assert_close(act.scales[:-1], scales, exact=True, what="scales")
    assert_close(act.sums[:-1], ref.act_sums(codes), exact=True, what="block sums")
    assert not act.codes[-1].any() and not act.scales[-1].any()  # the padding row
    if shape[1] >= 64:  # round half to even: 0.5 -> 0, 1.5 -> 2, -0.5 -> -0
        assert codes[-1, 32 + 16] == 0 and codes[-1, 32 + 17] == 2 and codes[-1, 32 + 15] == 0
    assert np.abs(ref.dequant_act(codes, scales) - x).max() <= np.abs(x).max() / 127 / 2 * (1 + 1e-6)


# ---- the spec against the formats and the f32 path ----------------------------------------------------------
@pytest.mark.parametrize("spec", IGEMM_SPECS)
def test_int_weight_is_the_format(spec):
    w = quantized(spec, (2, 24, 256), scale=0.05)
    iw = ref.int_weight(w)
    S = np.repeat(iw["S"], iw["bpg"] * 32, axis=2)[..., :256].astype(np.float64)
    dec = S * (iw["c"].astype(np.float64) + iw["o"])
    if iw["Z"] is not None:
        dec += np.repeat(iw["Z"], iw["g"], axis=2)
    assert iw["c"].dtype == np.uint8
    assert_close(dec.astype(np.float32), w.dequantize("numpy"), atol=1e-7, rtol=1e-6, what=spec)


@pytest.mark.parametrize("spec", ["int8", "int4-g64", "int3-g128", "q8_0", "q4_0", "q4_k"])
def test_ref_is_the_f32_path_on_dequantized_activations(spec):
    w = quantized(spec, (3, 20, 256), scale=0.05)
    seg_e, seg_lo, seg_hi = segments({2: 3, 0: 4})
    x = RNG.standard_normal((7, 256)).astype(np.float32)
    codes, scales = ref.quantize_act(x)
    want = np.zeros((7, 20))
    wd = w.dequantize("numpy").astype(np.float64)
    xh = ref.dequant_act(codes, scales).astype(np.float64)
    for e, lo, hi in zip(seg_e, seg_lo, seg_hi):
        want[lo:hi] = xh[lo:hi] @ wd[e].T
    got = ref.igemm(codes, scales, w, seg_e, seg_lo, seg_hi)
    assert_close(got, want.astype(np.float32), atol=1e-5 * np.abs(want).max(), what=spec)
    err = ref.activation_error(x, w, seg_e, seg_lo, seg_hi)
    assert 0 < err["rel_rms"] < 0.02  # 8-bit blocks of 32: about 0.5 % on Gaussian activations


@pytest.mark.parametrize("spec", ["fp8", "bf16", "f32"])
def test_unsupported_formats_refuse(spec):
    w = quantized(spec, (1, 16, 64), scale=0.05)
    assert not ref.supported(w.fmt)
    with pytest.raises(NotImplementedError):
        ref.int_weight(w)
    with pytest.raises(NotImplementedError):
        igemm.grouped_igemm(w, np.ones((1, 64), np.float32), [0], [0], [0], [1], np.ones(1, np.float32), 1)


# ---- the kernel ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", IGEMM_SPECS)
def test_igemm_kernels_exact(spec, kernel_build):
    """Both kernels forced, bit for bit the reference with power-of-two scales."""
    for case in (c for c in IGEMM_CASES if c[0] == spec):
        args = igemm_case(*case, exact=True)
        want = ref.igemm(*args)
        for path in PATHS:
            assert_close(run_kernel(args[2], *args[:2], *args[3:], path), want, exact=True,
                         what=f"{case_id(case)} path={path}")


@pytest.mark.parametrize("spec", IGEMM_SPECS)
def test_igemm_kernels_within_bound(spec, kernel_build):
    for case in (c for c in IGEMM_CASES if c[0] == spec):
        args = igemm_case(*case, exact=False)
        want, bound = ref.igemm(*args), ref.error_bound(*args)
        got = {path: run_kernel(args[2], *args[:2], *args[3:], path) for path in PATHS}
        for path, g in got.items():
            assert g.shape == want.shape and g.dtype == np.float32
            assert np.all(np.abs(g.astype(np.float64) - want) <= bound), f"{case_id(case)} path={path}"
        # the one-row kernel sums the same integer dots and takes the same f32 steps in the same order
        assert_close(got["gemv"], got["gemm"], exact=True, what=f"{case_id(case)}: gemv against the register tile")


@pytest.mark.parametrize("case", IGEMM_REAL, ids=case_id)
def test_igemm_kernels_mixtral_shape(case):
    args = igemm_case(*case, exact=False)
    want, bound = ref.igemm(*args), ref.error_bound(*args)
    for path in PATHS:
        err = np.abs(run_kernel(args[2], *args[:2], *args[3:], path).astype(np.float64) - want)
        assert np.all(err <= bound), f"{case_id(case)} path={path}: max err / bound {(err / bound).max():.3g}"


def test_grouped_igemm_routes_and_scales():
    """The drop-in entry: gathered rows -> out[slots] * scale; slots no segment covers stay 0."""
    w = quantized("q4_0", (3, 24, 128), scale=0.05)
    seg_e, seg_lo, seg_hi = segments({1: 3, 2: 2})
    xg = RNG.standard_normal((5, 128)).astype(np.float32)
    slots = np.array([4, 0, 6, 2, 1])
    scale = RNG.random(5).astype(np.float32)
    got = igemm.grouped_igemm(w, xg, slots, seg_e, seg_lo, seg_hi, scale, 8)
    codes, scales = ref.quantize_act(xg)
    y = ref.igemm(codes, scales, w, seg_e, seg_lo, seg_hi)
    want = np.zeros((8, 24), np.float32)
    want[slots] = y * scale[:, None]
    assert_close(got, want, atol=1e-5 * np.abs(want).max())
    assert not got[[3, 5, 7]].any()


def test_moe_igemm_quantizes_each_token_once():
    """Per-token activations, rows given by token: equal to quantizing the gathered rows."""
    w = quantized("int4-g64", (2, 16, 256), scale=0.05)
    x = RNG.standard_normal((3, 256)).astype(np.float32)
    rows = np.array([0, 2, 1, 0, 2])  # token of each gathered row (tokens 0 and 2 on both experts)
    seg_e, seg_lo, seg_hi = segments({0: 3, 1: 2})
    a = igemm.moe_igemm(w, igemm.quantize_act(x), rows, np.arange(5), seg_e, seg_lo, seg_hi, None, 5)
    b = igemm.grouped_igemm(w, x[rows], np.arange(5), seg_e, seg_lo, seg_hi, np.ones(5, np.float32), 5)
    assert_close(a, b, exact=True)


def test_repack_is_cached_once_per_weight():
    w = quantized("q8_0", (1, 16, 64), scale=0.05)
    assert igemm.packed(w) is igemm.packed(w)
    assert igemm.packed(quantized("q8_0", (1, 16, 64), scale=0.05)) is not igemm.packed(w)


# ---- assembly: the inner loop holds the wide integer multiply-adds -------------------------------------------------
HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+invpcid,+lzcnt,+mmx,+movbe,"
           "+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+x87,+xsave,+xsaveopt")
# dot lowering -> instructions the inner loop must hold, per code width class (8-bit codes, small codes)
EXPECT = {"avx512vnni": (["vpdpbusd"], ["vpdpbusd"]), "avxvnni": (["vpdpbusd"], ["vpdpbusd"]),
          "avx512bw": (["vpmaddwd"], ["vpmaddubsw", "vpmaddwd"]), "avx2": (["vpmaddwd"], ["vpmaddubsw", "vpmaddwd"])}
ASM_SPECS = ["int8", "q4_0", "int3-g64", "int2-g128", "q4_k"]


def _host_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(l for l in f if l.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


def check_assembly(low: str) -> list[str]:
    """Problems with the inner loops of the current target (empty: fine)."""
    problems = []
    for spec in ASM_SPECS:
        loop = igemm.hot_loop(igemm.assembly(spec))
        want = EXPECT[low][0 if get_format(spec).bits == 8 else 1]
        ops = [igemm.mnemonic(line) for line in loop]
        for op in want:
            if op not in ops:
                problems.append(f"{spec}: no {op} in the inner loop ({len(loop)} instructions)")
        if low in ("avx2", "avxvnni") and any("zmm" in line for line in loop):
            problems.append(f"{spec}: zmm registers on a 256-bit target")
        if ops.count("vpmulld"):
            problems.append(f"{spec}: vpmulld in the inner loop")
    return problems


def test_assembly_host():
    low = isa()
    if low not in EXPECT:
        pytest.skip(f"host target has no wide integer multiply-add (dot lowering {low!r})")
    assert check_assembly(low) == []


@pytest.mark.parametrize("variant", ["avx2", "avxvnni"])
def test_assembly_and_results_256_bit(variant, tmp_path):
    """Compile (and run: the host must execute it) for Haswell (AVX2), and Haswell + AVX-VNNI."""
    need = {"avx2": {"avx2", "fma"}, "avxvnni": {"avx2", "fma", "avx_vnni"}}[variant]
    if not need <= _host_flags():
        pytest.skip(f"host lacks {sorted(need - _host_flags())}: cannot run the {variant} build")
    feats = HASWELL + (",+avxvnni" if variant == "avxvnni" else "")
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": feats, "NUMBA_CACHE_DIR": str(tmp_path)}
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_igemm as t; "
            f"from toolkit.cpu.igemm_simd import isa; assert isa() == {variant!r}, isa(); "
            f"p = t.check_assembly({variant!r}); assert not p, p; "
            "t.test_igemm_kernels_exact('q4_0', 'x'); t.test_igemm_kernels_exact('int8', 'x'); t.test_igemm_kernels_exact('q4_k', 'x'); "
            "t.test_igemm_kernels_within_bound('int3-g64', 'x'); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
