"""fp8 prefill on Hopper's warpgroup MMA, without a GPU (and on one when it exists).

1. The emulated instruction (cuda_src/emu/wgmma_emu.h, reached through cuda_src/wgmma.cuh) against a plain matrix
   product: tests/cuda/wgmma_ops.cu stages the operands under the 128-byte swizzle and reads the accumulators by the
   PTX ISA's formulas, written out there independently of the emulator. Its rules, one broken at a time: a missing
   wgmma.fence, fence.proxy.async or commit stops the launch with what is missing; shared memory rewritten before
   the wait is what the wgmma reads, and accumulators read before it hold nothing yet.
   The sums are Hopper's, not f32's: fp8 wgmma keeps 13 bits of mantissa (cuda_src/wgmma.cuh; measured on an H100,
   2026-12-06: the fixture's largest error, to the bit, is the model's). ``fp22_product`` below is that model in
   NumPy, written apart from the emulator's.
2. moe_gemm_wgmma (cuda_src/moe_gemm_wgmma.cu), the kernel itself, through run_moe_gemm at block_m 128: within
   WG_TOL of max|out| of the NumPy reference (each k-tile's 13-bit sum added in f32); GEMM1 (alone and with
   silu_and_mul in its epilogue, the form fused_moe runs) and GEMM2, several and part-filled 128-token blocks, N past
   a whole tile, a short last K split, both thread orders; over K 4096 (the self-check) within LONG_K_TOL, which a
   kernel that let the wgmmas add up all of K misses by 10x; which devices take it.
"""
from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from helpers import assert_close, assert_close_but_requantized, run_on
from test_cuda_emulated import CASES, experts_after_a_hidden_one, routing, upper_bound_layout
from toolkit.errors import BackendError
from toolkit.formats import get_format
from toolkit.gpu import emulate
from toolkit.gpu.device import EmuDevice
from toolkit.gpu.moe_gemm import run_moe_gemm
from toolkit.gpu.moe_gemm_mma import block_m_for, has_wide
from toolkit.ops import get_op

RNG = np.random.default_rng(36)
WG_TOL = 2.0**-9  # of max|out|: a few 13-bit cuts of each k-tile's sum (the reference's are f32)
LONG_K_TOL = 5e-4  # of max|out| at K 4096: 1.3e-4 by the model when each k-tile starts afresh, 2.7e-3 when not
FIXTURE = CASES / "wgmma_ops.cu"


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """e4m3 codes (bytes) -> their values, float64."""
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def e4m3_codes(shape) -> np.ndarray:
    """Random finite e4m3 codes (no NaN: 0x7f / 0xff), as bytes."""
    v = RNG.standard_normal(shape).astype(np.float32)
    return v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def fp22_product(a: np.ndarray, b: np.ndarray, d: np.ndarray | None = None) -> np.ndarray:
    """A [M, K] . B [N, K]^T of e4m3 codes as Hopper's fp8 wgmma sums it, a K slice of 32 an instruction: d and the
    slice's exact products aligned to the largest one's exponent e, each cut toward zero to a multiple of
    2^(e - 13), added exactly (f32 result)."""
    a, b = e4m3_values(a), e4m3_values(b)
    d = np.zeros((a.shape[0], b.shape[0])) if d is None else d.astype(np.float64)
    for k in range(0, a.shape[1], 32):
        terms = np.concatenate([d[..., None], a[:, None, k:k + 32] * b[None, :, k:k + 32]], axis=-1)
        _, e = np.frexp(np.abs(terms).max(-1))
        q = np.ldexp(1.0, e - 1 - 13)[..., None]
        d = (np.trunc(terms / q) * q).sum(-1)
    return d.astype(np.float32)


def tile(mode: int, where: str = "emulated"):
    """The fixture's D, with the model's A . B^T and A . B2^T, and the exact A . B^T."""
    A, B, B2 = e4m3_codes((64, 128)), e4m3_codes((128, 128)), e4m3_codes((128, 128))
    D = np.full((64, 128), np.nan, np.float32)
    if where == "emulated":
        emulate.module(FIXTURE, ("wgmma_tile",)).launch("wgmma_tile", (1,), (128,), [A, B, B2, D, np.int32(mode)])
    else:
        D = _on_the_gpu([A, B, B2, D], mode)
    return D, fp22_product(A, B), fp22_product(A, B2), (e4m3_values(A) @ e4m3_values(B).T).astype(np.float32)


def _on_the_gpu(arrays, mode):
    """The fixture on an sm_90 GPU: compiled by NVRTC for sm_90a (as the GPU device builds moe_gemm_wgmma), loaded as
    a cubin: the hardware's own descriptor, swizzle and fragment against the same product."""
    import tempfile

    import cupy

    from toolkit.backend import cuda_unavailable_reason
    from toolkit.gpu import nvrtc

    if cuda_unavailable_reason() is not None:
        pytest.skip(str(cuda_unavailable_reason()))
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip(f"wgmma needs sm_90, this GPU is sm_{cupy.cuda.Device().compute_capability}")
    cubin, lowered = nvrtc.cubin_of(FIXTURE, ("wgmma_tile",), "sm_90a")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        fn = cupy.RawModule(path=f.name).get_function(lowered["wgmma_tile"])
    dev = [cupy.asarray(a) for a in arrays]
    fn((1,), (128,), (*dev, np.int32(mode)), shared_mem=3 * 64 * 128 + 1024)
    return cupy.asnumpy(dev[-1])


@pytest.mark.parametrize("where", ["emulated", "gpu"])
def test_wgmma_is_the_matrix_product(where):
    """m64n128k32 x 4 K slices: D = A . B^T through the descriptors, the swizzle and the accumulator fragment, summed
    as Hopper sums fp8 (fp22_product). Emulated: the model, bit for bit, and not f32's sums. On an sm_90 GPU (skipped,
    with the reason, elsewhere): within 4 cuts of the model (2^(e - 11), e the largest sum's exponent): the model was
    fitted to one H100 element, and its grouping of the 32 products of an instruction (32 or 8 fit that element)
    moves others by up to 2 cuts; a wrong descriptor, swizzle or fragment is off by O(max|D|)."""
    D, model, _, exact = tile(0, where)
    if where == "emulated":
        assert_close(D, model, exact=True, what="wgmma D, the FP22 model")
        assert not np.array_equal(D, exact), "13-bit sums, not f32's"
        return
    _, e = np.frexp(np.abs(exact).max())
    assert_close(D, model, atol=float(np.ldexp(1.0, e - 1 - 11)), what="wgmma D on the GPU vs the FP22 model")


def test_wgmma_reads_shared_memory_at_its_wait():
    """Asynchronous: B rewritten after the issue and before the wait is the B it multiplies (a kernel that frees a
    stage before the wait that retires its readers gets a wrong result), and the accumulators read before the wait
    hold nothing of it."""
    D, model, overwritten, _ = tile(4)
    assert_close(D, overwritten, exact=True, what="B rewritten before the wait")
    assert not np.allclose(D, model)
    D, *_ = tile(5)
    assert np.array_equal(D, np.zeros_like(D)), "accumulators read before the wait"


@pytest.mark.parametrize("mode,message", [
    (1, "without a wgmma.fence"),
    (2, "without a fence.proxy.async"),
    (3, "still in flight"),
])
def test_wgmma_rules_stop_the_launch(mode, message):
    """Each rule broken alone stops the emulated launch (an abort, in a child process) with what was missing."""
    code = ("import numpy as np, sys; sys.path[:0] = sys.argv[1:]\n"
            "import test_cuda_wgmma as t\n"
            f"t.tile({mode})\n")
    r = subprocess.run([sys.executable, "-c", code, str(CASES.parent), str(CASES.parents[1])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and message in r.stderr, (r.returncode, r.stderr[-2000:])


# ---- 2. the kernel --------------------------------------------------------------------------------------------
def near(got, want, what, tol=WG_TOL):
    """|got - want| within tol of max|want| (the 13-bit sums' cuts scale with the sums, not with each output)."""
    assert_close(got, want, atol=tol * float(np.abs(want).max()), what=what)


def check(rt, T, E, A, N, K, split=1):
    ids, tw = routing(T, E, A)
    w = experts_after_a_hidden_one("fp8", E, N, K)
    for slots, x in ((False, RNG.standard_normal((T, K)).astype(np.float32)),
                     (True, RNG.standard_normal((T * A, K)).astype(np.float32))):
        kw = dict(x_is_slots=slots, kind="mma", split=split)
        t = tw if slots else None
        got = run_on(rt, run_moe_gemm, x, w, *upper_bound_layout(EmuDevice(), ids, E, 128, hostile=slots), 128, A, t, **kw)
        what = "GEMM2" if slots else "GEMM1"
        sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, 128)
        plain = get_op("moe_gemm", "numpy")(x, w, sorted_ids, expert_ids, 128, A, t, x_is_slots=slots)
        near(got, plain, f"{what} vs the reference")
        if not slots and split == 1:  # GEMM1 of gate_up [E, 2I, K] with silu_and_mul in the epilogue
            h = run_on(rt, run_moe_gemm, x, w, *upper_bound_layout(EmuDevice(), ids, E, 128), 128, A, kind="mma", silu=True)
            near(h, get_op("silu_and_mul", "numpy")(plain), "GEMM1 + silu vs the reference")


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("T,E,A,N,K,split", [
    (70, 4, 2, 136, 288, 1),  # part-filled blocks, N past a whole 128-row tile, K not a whole k-tile
    (150, 2, 2, 128, 256, 1),  # several 128-token blocks of one expert
    (5, 4, 2, 64, 640, 3),  # K split in 3, the last short (256, 256, 128)
    (20, 4, 2, 64, 1024, 1),  # 8 k-tiles: every stage reused twice
])
def test_moe_gemm_wgmma(order, T, E, A, N, K, split):
    check(EmuDevice(reverse=order == "reverse"), T, E, A, N, K, split)


def test_wgmma_is_taken_where_it_runs():
    """fp8 experts get 128-token blocks on sm_90 (both GEMMs: block_m_for's ``wide``), not on sm_89 (e4m3 mma.sync,
    no wgmma) or sm_80 (no e4m3 at all), and asking for them there is refused by name."""
    E, N, K = 4, 128, 256
    w = get_format("fp8").quantize(RNG.standard_normal((E, N, K)).astype(np.float32))
    assert has_wide(EmuDevice(arch=900), w) and not has_wide(EmuDevice(arch=890), w)
    assert not has_wide(EmuDevice(arch=800), w)
    assert block_m_for(96 * E, E, wide=has_wide(EmuDevice(arch=900), w)) == 128
    ids, _ = routing(3, E, 2)
    layout = upper_bound_layout(EmuDevice(), ids, E, 128)
    x = RNG.standard_normal((3, K)).astype(np.float32)
    with pytest.raises(BackendError, match=r"e4m3 experts at block_m 128 run on wgmma \(sm_90\).*sm_89"):
        run_moe_gemm(EmuDevice(arch=890), x, w, *layout, 128, 2, kind="mma")
    odd = get_format("fp8").quantize(RNG.standard_normal((E, N, 96)).astype(np.float32))
    assert has_wide(EmuDevice(arch=900), odd)  # K 96: a multiple of 16


@pytest.mark.parametrize("arch,stem", [(900, "moe_gemm_wgmma"), (890, "moe_gemm_mma")])
def test_fused_moe_takes_wgmma_at_prefill(arch, stem):
    """ops.fused_moe with fp8 experts once they fill 128-token blocks: both GEMMs on wgmma on sm_90 (132 KB of dynamic
    shared memory a block), on mma.sync at 64 on sm_89. The layer's results differ as two W8A8 paths whose GEMM1
    sums differ in their last bits do (13-bit sums against f32's, above): a few of GEMM1's outputs re-quantize to the
    next e4m3 code, so a few outputs move by one code's worth (2.2 % of them past 2^-9 of max|out|, the largest
    1.2 %, here); the rest agree within WG_TOL."""
    from toolkit.gpu.fused_moe import run_fused_moe
    from toolkit.gpu.moe_gemm_wgmma import SMEM
    from test_cuda_mma import LaunchSpy
    from toolkit.gpu.ops import DeviceOps

    E, A, D, I, T = 2, 2, 128, 128, 200  # 400 slots over 2 experts: 200 a block of 128 fills most
    ids, tw = routing(T, E, A)
    f = get_format("fp8")
    gate_up = f.quantize(RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1)
    down = f.quantize(RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    rt = LaunchSpy(arch=arch)
    got = run_on(rt, lambda dev, *a: DeviceOps(dev).fused_moe(*a), x, tw, ids, gate_up, down)
    picked = rt.picked
    assert len(picked) == 2 and {p[0] for p in picked} == {stem}, picked
    assert all(smem == (SMEM if arch == 900 else 0) for *_, smem in picked), picked
    want = run_on(EmuDevice(arch=890), run_fused_moe, x, tw, ids, gate_up, down, 64)
    assert_close_but_requantized(got, want, tol=WG_TOL, stray=0.03, stray_frac=0.05,
                                 what="the fused layer, sm_90 vs sm_89")


def test_the_gpu_loads_an_sm_90a_cubin_with_wgmma():
    """What CupyDevice loads for this stem (CuPy's RawModule cannot compile sm_90a): NVRTC's cubin for sm_90a, whose
    SASS runs the four m64n128k32 e4m3 wgmmas of a k-tile (QGMMA) with one wait a k-tile, not one per wgmma (what
    ptxas does when it serializes them) and the mangled name it is looked up by."""
    from toolkit.gpu import nvrtc

    why = nvrtc.missing_reason()
    if why is not None or not nvrtc.nvdisasm():
        pytest.skip(why or "no nvdisasm (the cuda13 extra's cuda-toolkit[nvdisasm])")
    cubin, lowered = nvrtc.build("moe_gemm_wgmma", 90)
    assert lowered["moe_gemm_wgmma_e4m3"].encode() in cubin
    sass = nvrtc.sass_text(cubin)[lowered["moe_gemm_wgmma_e4m3"]]
    assert sass.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 4, "four wgmma a k-tile, in one loop body"
    assert sass.count("WARPGROUP.DEPBAR") == 1, "one wait a k-tile (wgmma_wait<0>), before its sum is added in f32"


def test_self_check_passes_the_kernel_and_catches_a_wrong_one():
    """What a GPU runs before it trusts the kernel (moe_gemm_wgmma.verified): one block against NumPy. The kernel
    passes it here; a device whose wgmma launches write zeros fails it, and a GPU that fails it gets no 128-token
    fp8 blocks (mma.sync at 64 instead), with a warning."""
    from toolkit.gpu import moe_gemm_wgmma as wg
    from toolkit.gpu.moe_gemm_mma import run_moe_gemm_mma

    ok, err = wg.self_check(EmuDevice(), run_moe_gemm_mma)  # K 4096: LONG_K_TOL
    assert ok and err <= LONG_K_TOL, err

    class Broken(EmuDevice):  # its wgmma launches write zeros
        def launch(self, stem, kernel, grid, block, args, shared_mem=0):
            super().launch(stem, kernel, grid, block, args, shared_mem)
            if stem == wg.SOURCE:
                args[8][...] = 0.0  # out

    class BrokenGpu(Broken):  # as a real sm_90 GPU: why_not runs verified(), which runs the self-check once
        name, arch = "cuda", 900

    assert wg.self_check(Broken(), run_moe_gemm_mma) == (False, 1.0)
    rt = BrokenGpu()
    w = get_format("fp8").quantize(RNG.standard_normal((4, 128, 256)).astype(np.float32))
    with pytest.warns(UserWarning, match="self-check on this GPU"):
        assert not has_wide(rt, w)
    assert wg.why_not(rt, w, 128, 0, run_moe_gemm_mma).startswith("its self-check on this GPU disagreed")
