"""The tensor-core path of the CUDA backend, without a GPU (and on one when it exists).

1. The emulated PTX instructions (cuda_src/emu/ptx_emu.h, reached through cuda_src/mma.cuh) against plain matrix
   products and the PTX ISA's fragment formulas, with data moved by tests/cuda/ptx_ops.cu: mma.sync for f16, bf16
   and e4m3, ldmatrix x4 / x2 / x4.trans, cp.async groups (landing order, zero fill). The same fixtures run on a
   GPU when CuPy sees one (the hardware's own fragment mapping).
2. moe_gemm_mma (cuda_src/moe_gemm_mma.cu: the kernel itself, no scalar stand-in) forwards and backwards over a
   shape table x formats x block_m, GEMM1 and GEMM2 on moe_align's upper-bound layout:
   - against the reference on operands rounded as the kernel rounds them (activations and decoded weights to f16
     or bf16; e4m3 W8A8: none, the reference quantizes the activations itself): MMA_TOL, f32 summation order only;
   - against the plain f32 reference: ROUNDING_TOL (f16: 2^-11 relative per operand; bf16: 2^-8).
   Mixtral's real K (4096 and 14336) at M = 1 and 16 on a slice of its rows; the K split; the fused layer;
   affine codes and GGML blocks of 32 repacked for the kernel (toolkit/gpu/mma_pack.py) give bit-identical results.
3. kv_attention_mma (prefill attention on tensor cores, f16 products) against the f32 reference: ATT_MMA_TOL.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from helpers import assert_close, run_on
from test_cuda_emulated import CASES, experts_after_a_hidden_one, kv_case, routing, upper_bound_layout
from toolkit.backend import cuda_unavailable_reason
from toolkit.errors import BackendError
from toolkit.formats import get_format
from toolkit.gpu import emulate, mma_pack
from toolkit.gpu.device import EmuDevice
from toolkit.gpu.fused_moe import run_fused_moe
from toolkit.gpu.kv_attention import run_kv_attention
from toolkit.gpu.moe_gemm import default_kind, run_moe_gemm
from toolkit.gpu.moe_gemm_mma import BLOCK_OVERHEAD_TILES, block_m_for, k_align, split_for
from toolkit.ops import get_op

RNG = np.random.default_rng(12)
OPERAND = {"OpF16": np.float16, "OpBf16": ml_dtypes.bfloat16, "OpE4m3": ml_dtypes.float8_e4m3fn}
INSTR_TOL = dict(atol=1e-5, rtol=1e-5)  # exact products, f32 sums in another order
MMA_TOL = dict(atol=5e-5, rtol=2e-5)  # vs the reference on the kernel's rounded operands
ROUNDING_TOL = {"f16": dict(atol=1e-2, rtol=3e-3), "bf16": dict(atol=6e-2, rtol=3e-2)}  # vs plain f32 (outputs ~5)
MMA_FORMATS = ["int8", "int4-g128", "int4", "int3-g128", "int2-g128", "int4-g32", "q8_0", "q4_0", "mxfp4", "q4_k", "fp8"]
MMA_SHAPES = [(1, 8, 2, 64, 256), (5, 4, 2, 72, 256), (24, 4, 2, 136, 256)]  # T, E, A, N, K (N % 64 != 0 too)
PTX_KERNELS = ("mma_one<OpF16>", "mma_one<OpBf16>", "mma_one<OpE4m3>", "ldmatrix_all", "cp_async_groups", "read_at")
GPU_MISSING = cuda_unavailable_reason()


@pytest.fixture(params=["forward", "reverse"])
def rt(request):
    return EmuDevice(reverse=request.param == "reverse")


# ---- 1. the instructions ----------------------------------------------------------------------------------------
@functools.cache
def _gpu_module():
    import cupy

    from toolkit.gpu.source import nvrtc_options

    return cupy.RawModule(code=(CASES / "ptx_ops.cu").read_text(), name_expressions=list(PTX_KERNELS),
                          options=nvrtc_options())


def run_fixture(where: str, kernel: str, inputs: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """One block of 32 threads of tests/cuda/ptx_ops.cu: emulated, or on the GPU."""
    if where == "emulated":
        emulate.module(CASES / "ptx_ops.cu", PTX_KERNELS).launch(kernel, (1,), (32,), [*inputs, out])
        return out
    import cupy

    dev = [cupy.asarray(a) for a in inputs] + [cupy.asarray(out)]
    _gpu_module().get_function(kernel)((1,), (32,), tuple(dev))
    return cupy.asnumpy(dev[-1])


WHERE = ["emulated", pytest.param("gpu", marks=pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING)))]


def operand(op, shape):
    """Random values exactly representable in the operand type (e4m3: no NaN codes)."""
    return (RNG.standard_normal(shape) * 2).astype(OPERAND[op])


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("op", list(OPERAND))
def test_ptx_mma_is_a_matrix_product(where, op):
    """d = c + A B for A [16 x 32 bytes of K], B [32 bytes of K x 8], fragments placed by the ISA's formulas."""
    per = 32 // np.dtype(OPERAND[op]).itemsize  # K elements per 32 bytes
    A, B = operand(op, (16, per)), operand(op, (8, per))  # B as its 8 columns
    C = RNG.standard_normal((16, 8)).astype(np.float32)
    D = run_fixture(where, f"mma_one<{op}>", [A.view(np.uint32), B.view(np.uint32), C], np.zeros((16, 8), np.float32))
    want = (C.astype(np.float64) + A.astype(np.float64) @ B.astype(np.float64).T).astype(np.float32)
    assert_close(D, want, **INSTR_TOL)


@pytest.mark.parametrize("where", WHERE)
def test_ptx_ldmatrix_fragments(where):
    """Lane l gets row l // 4, word l % 4 of each 8x8 b16 matrix (.trans: the b16 pair down column l // 4)."""
    M = RNG.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32)
    out = run_fixture(where, "ldmatrix_all", [M], np.zeros((3, 32, 4), np.uint32))
    lanes = np.arange(32)
    for i in range(4):
        assert_close(out[0, :, i], M[8 * i + lanes // 4, lanes % 4], exact=True, what=f"x4 matrix {i}")
    for i in range(2):
        assert_close(out[1, :, i], M[8 * i + lanes // 4, lanes % 4], exact=True, what=f"x2 matrix {i}")
    h = M.view(np.uint16)  # [32 rows, 8 b16]
    for i in range(4):
        lo = h[8 * i + 2 * (lanes % 4), lanes // 4].astype(np.uint32)
        hi = h[8 * i + 2 * (lanes % 4) + 1, lanes // 4].astype(np.uint32)
        assert_close(out[2, :, i], lo | (hi << 16), exact=True, what=f"x4.trans matrix {i}")


@pytest.mark.parametrize("where", WHERE)
def test_ptx_cp_async_groups(where):
    src = RNG.standard_normal((3, 128)).astype(np.float32)
    out = run_fixture(where, "cp_async_groups", [src], np.zeros((2, 3, 128), np.float32))
    after_all = src.copy()
    after_all[2].reshape(32, 4)[1::2] = 0.0  # odd lanes of group 2 copied 0 source bytes: zero fill
    assert_close(out[1], after_all, exact=True, what="after wait_group 0")
    assert_close(out[0, 0], src[0], exact=True, what="group 0 after wait_group 2")
    if where == "emulated":  # the emulator lands a group only when a wait retires it (a GPU may land it earlier)
        assert (out[0, 1:] == -1.0).all(), "groups 1-2 landed before any wait retired them"


@pytest.mark.parametrize("how", [0, 1, 2], ids=["ldg", "cp_async", "prefetch_l2"])
def test_emulator_stops_a_read_past_an_array(how):
    """__ldg and cp.async read only the launch's arrays on the emulated device (as a GPU faults, or reads another
    allocation): in bounds the read is the array's bytes; 16 bytes past the end stop the launch (an abort, in a
    child process) with what was wrong. A prefetch into L2 is held to the same rule (on a GPU it would fetch another
    allocation's line, or nothing): a kernel's prefetches name the tiles it reads."""
    src = RNG.standard_normal(128).astype(np.float32)
    out = run_fixture("emulated", "read_at", [src, np.array([0, how], np.int32)], np.zeros(128, np.float32))
    assert_close(out, src, exact=True, what="in bounds")
    code = ("import numpy as np, sys; sys.path[:0] = sys.argv[1:]\n"
            "import test_cuda_mma as t\n"
            f"t.run_fixture('emulated', 'read_at', [np.zeros(128, np.float32), np.array([4, {how}], np.int32)], "
            "np.zeros(128, np.float32))\n")
    r = subprocess.run([sys.executable, "-c", code, str(CASES.parent), str(CASES.parents[1])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "outside the launch's arrays" in r.stderr, (r.returncode, r.stderr[-2000:])


# ---- 2. moe_gemm_mma --------------------------------------------------------------------------------------------
def rounded_reference(x, w, ids, tw, A, op: str, slots: bool):
    """out[s] = round(x_row(s)) . round(dequant(w[e(s)])).T (x tw[s]): the products the MMA kernel makes."""
    dt = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}[op]
    xr = x.astype(dt).astype(np.float64)
    wr = mma_pack.dequantize(w) if mma_pack.packing(w) else w.dequantize("numpy")  # [E, N, K] (packed: GGML, k-quants)
    if not (w.fmt.name == "int8" and op == "f16"):  # int8 with f16 operands: exact codes, f32 row scale on the sums
        wr = wr.astype(dt)
    wr = wr.astype(np.float64)
    e = ids.reshape(-1)
    rows = np.arange(e.size) if slots else np.arange(e.size) // A
    out = np.einsum("sk,snk->sn", xr[rows], wr[e])
    if tw is not None:
        out *= tw.reshape(-1, 1)
    return out.astype(np.float32)


def check_gemm(rt, x, w, ids, tw, E, A, block_m, op="f16", **kw):
    """GEMM1 (tokens) or GEMM2 (slots, routing weight; ``tw`` given) against both references."""
    slots = tw is not None
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, block_m)
    ub_s, ub_e = upper_bound_layout(EmuDevice(), ids, E, block_m, hostile=slots)
    got = run_on(rt, run_moe_gemm, x, w, ub_s, ub_e, block_m, A, tw, x_is_slots=slots, kind="mma", op=op, **kw)
    plain = get_op("moe_gemm", "numpy")(x, w, sorted_ids, expert_ids, block_m, A, tw, x_is_slots=slots)
    what = "GEMM2" if slots else "GEMM1"
    if w.fmt.act_quant is not None:  # e4m3 W8A8: the reference makes the same e4m3 products
        assert_close(got, plain, **MMA_TOL, what=what)
    else:
        assert_close(got, rounded_reference(x, w, ids, tw, A, op, slots), **MMA_TOL, what=f"{what} vs rounded operands")
        assert_close(got, plain, **ROUNDING_TOL[op], what=f"{what} vs f32")


@pytest.mark.parametrize("shape", MMA_SHAPES)
@pytest.mark.parametrize("fmt", MMA_FORMATS)
@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_gemm_mma(rt, shape, fmt, block_m):
    T, E, A, N, K = shape
    ids, tw = routing(T, E, A)
    w = experts_after_a_hidden_one(fmt, E, N, K)
    check_gemm(rt, RNG.standard_normal((T, K)).astype(np.float32), w, ids, None, E, A, block_m)
    check_gemm(rt, RNG.standard_normal((T * A, K)).astype(np.float32), w, ids, tw, E, A, block_m)


@pytest.mark.parametrize("fmt", ["int4-g128", "int8"])
def test_moe_gemm_mma_bf16_operands(rt, fmt):
    T, E, A, N, K = 5, 4, 2, 72, 256
    ids, tw = routing(T, E, A)
    w = experts_after_a_hidden_one(fmt, E, N, K)
    check_gemm(rt, RNG.standard_normal((T * A, K)).astype(np.float32), w, ids, tw, E, A, 16, op="bf16")


@pytest.mark.parametrize("fmt", ["int4-g128", "fp8"])
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_moe_gemm_mma_mixtral_k(fmt, T, gemm):
    """Mixtral's real reduction lengths (D = 4096 for gate_up, I = 14336 for down), 8 experts, top-2, on a slice of
    64 output rows (the whole 28672 / 4096 rows only multiply the grid); the K split the launcher picks."""
    E, A = 8, 2
    N, K = (64, 4096) if gemm == "gate_up" else (64, 14336)
    ids, tw = routing(T, E, A)
    w = get_format(fmt).quantize(RNG.standard_normal((E, N, K)).astype(np.float32) * 0.02)
    block_m = block_m_for(T * A, E)
    if gemm == "gate_up":
        check_gemm(EmuDevice(), RNG.standard_normal((T, K)).astype(np.float32), w, ids, None, E, A, block_m)
    else:
        check_gemm(EmuDevice(), RNG.standard_normal((T * A, K)).astype(np.float32), w, ids, tw, E, A, block_m)


@pytest.mark.parametrize("K,split", [(96, 1), (160, 1), (608, 1), (608, 3), (640, 2)])
def test_int8_codes_ring_over_odd_and_partial_tiles(rt, K, split):
    """int8 W8A16 fetches its codes ROW_RING_TILES k-tiles ahead: tile counts that are odd (1.5, 2.5, 9.5 tiles of
    64; 5 per split) and a partial last tile, N past a whole tile, in both thread orders."""
    T, E, A, N = 3, 4, 2, 72
    ids, tw = routing(T, E, A)
    w = experts_after_a_hidden_one("int8", E, N, K)
    check_gemm(rt, RNG.standard_normal((T * A, K)).astype(np.float32), w, ids, tw, E, A, 16, split=split)


@pytest.mark.parametrize("split", [1, 2, 5])
def test_moe_gemm_mma_k_split(split):
    """Split-K partials (including a split that leaves the last chunk short) sum to the unsplit result."""
    T, E, A, N, K = 3, 4, 2, 64, 640
    ids, tw = routing(T, E, A)
    w = experts_after_a_hidden_one("int4-g128", E, N, K)
    check_gemm(EmuDevice(), RNG.standard_normal((T * A, K)).astype(np.float32), w, ids, tw, E, A, 16, split=split)


def test_split_and_block_m_tables():
    assert block_m_for(2, 8) == 16 and block_m_for(8192, 8) == 64  # Mixtral decode / 4096-token prefill
    assert block_m_for(8192, 8, wide=True) == 128  # ... where both GEMMs have 128-token tiles
    slots = 132 * 4  # an H200 at the 4 blocks per SM of the decode kernels
    assert split_for(2, 448, 4096, 2, slots) == (1, 4096)  # Mixtral GEMM1 at M = 1: 896 blocks already fill it
    # GEMM2 at M = 1: 128 blocks -> 4 splits of 56 k-tiles, one full wave (8 splits: two waves of 28, no faster)
    assert split_for(2, 64, 14336, 2, slots) == (4, 3584)
    assert split_for(128, 448, 4096, 2, slots) == (1, 4096)  # prefill: the grid is already full
    split, chunk = split_for(3, 5, 14336, 1, slots)  # e4m3: 128-element k-tiles; a short last split
    assert chunk % 128 == 0 and split * chunk >= 14336 > (split - 1) * chunk
    # q2_K (k_align 4): chunks of whole super-blocks of 256; Mixtral's GEMM2 at M = 1 splits as above
    assert split_for(2, 64, 14336, 2, slots, align=4) == (4, 3584)
    for blocks in (1, 7, 100, 300):
        split, chunk = split_for(blocks, 1, 4096, 2, slots, align=4)
        assert chunk % 256 == 0 and chunk >= 256 and split == -(-4096 // chunk), (blocks, split, chunk)


def test_k_align_is_the_q2k_super_block():
    w = get_format("q2_k").quantize(RNG.standard_normal((2, 64, 512)).astype(np.float32))
    assert k_align(w) == 1 and k_align(mma_pack.pack(w)) == 4  # stored: any k-tile; packed: its super-block
    assert all(k_align(mma_pack.pack(get_format(f).quantize(RNG.standard_normal((2, 64, 512)).astype(np.float32))))
               == 1 for f in ("q3_k", "int2-g64"))


@pytest.mark.parametrize("blocks,tiles", [(1, 64), (7, 64), (100, 224), (128, 224), (300, 64), (527, 64), (33, 448)])
def test_split_fills_the_last_wave(blocks, tiles):
    """The split's waves of k-tiles (plus each block's fixed cost) take no longer than any other split's, at >= 4
    k-tiles per split; a grid that already fills the GPU is not split."""
    slots, K, c = 528, tiles * 64, BLOCK_OVERHEAD_TILES
    split, chunk = split_for(blocks, 1, K, 2, slots)
    waves = lambda s, per: -(-blocks * s // slots) * (per + c)  # noqa: E731
    best = min(waves(s, -(-tiles // s)) for s in range(1, tiles // 4 + 1))
    assert waves(split, chunk // 64) == best and chunk // 64 >= 4
    assert split_for(blocks + slots, 1, K, 2, slots) == (1, K)


def test_default_kind_by_architecture(monkeypatch):
    w = get_format("fp8")
    assert default_kind(EmuDevice(arch=900), get_format("int4"), True) == "mma"
    assert default_kind(EmuDevice(arch=900), w, False) == "mma"
    assert default_kind(EmuDevice(arch=800), w, False) == "tiled"  # no e4m3 MMA before sm_89
    assert default_kind(EmuDevice(arch=800), get_format("int4"), True) == "mma"
    assert default_kind(EmuDevice(), get_format("int4"), True) == "splitk"  # architecture unknown: no MMA
    monkeypatch.setenv("MOQE_CUDA_TENSOR_CORES", "0")  # switched off: the f32 kernels on any device
    assert default_kind(EmuDevice(arch=900), get_format("int4"), False) == "tiled"


def test_mma_contract_errors():
    T, E, A, N, K = 2, 4, 2, 64, 128
    ids, _ = routing(T, E, A)
    w = get_format("int3-g128").quantize(RNG.standard_normal((E, N, K)).astype(np.float32))
    s, e = upper_bound_layout(EmuDevice(), ids, E, 16)
    x = RNG.standard_normal((T, K)).astype(np.float32)
    with pytest.raises(BackendError, match="operand bf16 is built for int8 and int4"):
        run_moe_gemm(EmuDevice(), x, w, s, e, 16, A, kind="mma", op="bf16")
    fp8 = get_format("fp8").quantize(RNG.standard_normal((E, N, K)).astype(np.float32))
    with pytest.raises(BackendError, match="needs the e4m3 MMA"):
        run_moe_gemm(EmuDevice(arch=800), x, fp8, s, e, 16, A, kind="mma")


@pytest.mark.parametrize("fmt", ["int4-g128", "fp8", "q4_0"])
@pytest.mark.parametrize("T", [1, 40])
def test_fused_moe_on_tensor_cores(fmt, T):
    """The layer's stages with both GEMMs on moe_gemm_mma (an sm_90 device picks it), block_m from the table."""
    rt = EmuDevice(arch=900)
    E, A, D, I = 8, 2, 128, 256
    ids, tw = routing(T, E, A)
    f = get_format(fmt)
    gate_up = f.quantize(RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1)
    down = f.quantize(RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    block_m = block_m_for(T * A, E)
    want = get_op("fused_moe", "numpy")(x, tw, ids, gate_up, down, block_m=block_m)
    tol = dict(atol=1e-2, rtol=1e-2) if fmt == "fp8" else ROUNDING_TOL["f16"]
    assert_close(run_on(rt, run_fused_moe, x, tw, ids, gate_up, down, block_m), want, **tol)


@pytest.mark.parametrize("fmt", ["int4-g128", "int8", "fp8", "q4_k"])
@pytest.mark.parametrize("T,block_m", [(1, 16), (30, 64)])
def test_gemm1_with_silu_in_the_epilogue(rt, fmt, T, block_m):
    """GEMM1 with silu_and_mul fused: h = silu(gate) * up straight from the accumulators ([T*A, I], I not a
    multiple of the 32 outputs a block makes)."""
    E, A, I, K = 4, 2, 48, 256
    ids, _ = routing(T, E, A)
    w = experts_after_a_hidden_one(fmt, E, 2 * I, K)
    x = RNG.standard_normal((T, K)).astype(np.float32)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, block_m)
    ub_s, ub_e = upper_bound_layout(EmuDevice(), ids, E, block_m)
    got = run_on(rt, run_moe_gemm, x, w, ub_s, ub_e, block_m, A, kind="mma", silu=True)
    silu = get_op("silu_and_mul", "numpy")
    if w.fmt.act_quant is None:
        want = silu(rounded_reference(x, w, ids, None, A, "f16", False))
        assert_close(got, want, **MMA_TOL, what="vs rounded operands")
    want = silu(get_op("moe_gemm", "numpy")(x, w, sorted_ids, expert_ids, block_m, A))
    assert_close(got, want, **(MMA_TOL if w.fmt.act_quant is not None else ROUNDING_TOL["f16"]), what="vs f32")


ATT_MMA_TOL = dict(atol=4e-3, rtol=4e-3)  # q, k, v and p rounded to f16; outputs are averages of |v| ~ 1
ATT_MMA_SHAPES = [(1, 24, 8, 2, 128, 40, 10), (2, 7, 4, 1, 64, 16, 0), (1, 40, 2, 2, 32, 70, 30),
                  (1, 5, 12, 4, 96, 33, 28)]  # (B, T, H, Hkv, hd, S, start): 64-row blocks, partial ones, GQA, MQA


@pytest.mark.parametrize("shape", ATT_MMA_SHAPES)
@pytest.mark.parametrize("kf,vf", [("f32", "f32"), ("q8_0", "q4_0"), ("q4_0", "q8_0")])
@pytest.mark.parametrize("window", [0, 5])
def test_prefill_attention_on_tensor_cores(rt, shape, kf, vf, window):
    q, ks, vs, k_fmt, v_fmt, positions, scale = kv_case(kf, vf, *shape)
    want = get_op("kv_attention", "numpy")(q, ks, vs, k_fmt, v_fmt, positions, scale, window)
    got = run_on(rt, run_kv_attention, q, ks, vs, k_fmt, v_fmt, positions, scale, window, kind="mma")
    assert_close(got, want, **ATT_MMA_TOL, what=f"K {kf} / V {vf}, window {window}")


def test_prefill_attention_with_sinks_and_the_automatic_choice():
    """An sm_90 device takes the MMA kernel for prefill (T * H / Hkv >= 16) by itself; gpt-oss's sinks."""
    q, ks, vs, k_fmt, v_fmt, positions, scale = kv_case("q8_0", "q8_0", 1, 12, 8, 2, 64, 20, 6)
    sinks = RNG.standard_normal(8).astype(np.float32)
    want = get_op("kv_attention", "numpy")(q, ks, vs, k_fmt, v_fmt, positions, scale, 0, sinks=sinks)
    picked = []

    class Spy(EmuDevice):
        def launch(self, stem, kernel, grid, block, args, shared_mem=0):
            picked.append(kernel)
            super().launch(stem, kernel, grid, block, args, shared_mem)

    got = run_on(Spy(arch=900), run_kv_attention, q, ks, vs, k_fmt, v_fmt, positions, scale, 0, sinks=sinks)
    assert picked == ["kv_attention_mma<Q8_0Row, Q8_0Row>"], picked
    assert_close(got, want, **ATT_MMA_TOL)


PACK_FORMATS = ["int4-g128", "int3-g64", "int2-g64"]
GGML_PACK_FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4"]


@pytest.mark.parametrize("fmt", PACK_FORMATS)
@pytest.mark.parametrize("halves", [False, True])
def test_mma_pack_is_a_permutation_of_the_codes(fmt, halves):
    qt = get_format(fmt).quantize(RNG.standard_normal((3, 128, 256)).astype(np.float32))
    packed = mma_pack.pack(qt, halves)
    (key,) = [k for k in packed.arrays if k.startswith("mma_codes")]
    assert packed.arrays[key].shape == mma_pack.packed_shape(qt) and packed.nbytes == qt.nbytes
    assert not np.array_equal(packed.arrays[key].reshape(-1), qt.arrays["qweight"].reshape(-1))  # it did move
    assert_close(mma_pack.unpack(packed).arrays["qweight"], qt.arrays["qweight"], exact=True)
    # pair p of chunk j where formats.cuh AffinePackedDec::q_f16 reads it: thread 1's chunk 0 (row 0, k 8..15)
    b, codes = qt.fmt.bits, mma_pack._codes(packed)[0, 0, 8:16]
    words = [int(w) for w in packed.arrays[key][0, 0, 0].view(np.uint32)[b:2 * b]]  # thread 1's b words
    if b == 3:  # pair p of chunk 0 whole in word 0 at bit 3p and 16 above (mma_pack.THREE); chunk 3's pair 3 (the
        # tile's row 48, k 14 and 15) bit by bit at bit 15 and 31 of the three words
        got = [(words[0] >> (3 * p + 16 * h)) & 7 for p in range(4) for h in (0, 1)]
        last = [sum(((words[i] >> (15 + 16 * h)) & 1) << i for i in range(3)) for h in (0, 1)]
        assert last == mma_pack._codes(packed)[0, mma_pack._tile_rows(128, halves)[0, 48], 14:16].tolist()
    else:  # int4: nibbles p and p + 4 of the chunk's word; int2: bits 2p and 16 + 2p of the word of chunks 0 and 1
        got = [(words[0] >> (b * p + 16 * h)) & ((1 << b) - 1) for p in range(4) for h in (0, 1)]
    assert got == codes.tolist()
    assert not mma_pack.packable(get_format(fmt).quantize(RNG.standard_normal((2, 72, 128)).astype(np.float32)))


@pytest.mark.parametrize("fmt", GGML_PACK_FORMATS)
@pytest.mark.parametrize("halves", [False, True])
def test_ggml_blocks_repack_to_the_same_weights(fmt, halves):
    """A GGML block of 32 splits into codes, scale and minimum that give back every stored weight exactly (in f32,
    before the kernel's one rounding to f16), with the codes of each tile where the kernel's threads read them."""
    w = RNG.standard_normal((3, 128, 256)).astype(np.float32) * 0.05
    w[0, 5, :32] = 0.0  # an all-zero block (mxfp4: exponent 0)
    qt = get_format(fmt).quantize(w)
    packed = mma_pack.pack(qt, halves)
    assert set(packed.arrays) == set(mma_pack.array_specs(packed))
    for name, (dtype, shape) in mma_pack.array_specs(packed).items():
        assert packed.arrays[name].dtype == dtype and packed.arrays[name].shape == shape, name
    assert_close(mma_pack.dequantize(packed), qt.dequantize(), exact=True)
    assert packed.nbytes == qt.nbytes + (qt.shape[0] * 128 * 256 // 32 if fmt == "mxfp4" else 0)  # mxfp4: f16 scale
    # thread 1's first chunk of tile (0, 0) is row 0 (natural) / gate row 0, k 8..15, where the decoder reads it
    want = mma_pack.ggml_codes(packed)[0, 0, 8:16].astype(np.uint32)
    tile = packed.arrays[mma_pack.KEYS["halves" if halves else "natural"]][0, 0, 0]
    if mma_pack.code_bits(qt.fmt) == 8:
        assert np.array_equal(tile[16:24], want)
    else:  # pair p of the chunk's word: nibbles p and p + 4 (q5: chunk 0's fifth bits at 0, 4, 1, 5 and 16 above)
        word = int(tile[16:20].view(np.uint32)[0])
        got = [(word >> (4 * p + 16 * h)) & 15 for p in range(4) for h in (0, 1)]
        if fmt == "mxfp4":  # (exponent, mantissa) at 0, 3, 8, 11, signs at 6, 7, 14, 15, and 16 above (mma_pack.E2M1)
            em, sg = [0, 3, 8, 11], [6, 7, 14, 15]
            got = [((word >> (em[p] + 16 * h)) & 7) | (((word >> (sg[p] + 16 * h)) & 1) << 3) for p in range(4) for h in (0, 1)]
        if fmt.startswith("q5"):
            hb = int(tile[128 * 16 + 4:128 * 16 + 8].view(np.uint32)[0])
            got = [g | (((hb >> ([0, 4, 1, 5][p] + 16 * h)) & 1) << 4) for g, (p, h) in zip(got, [(p, h) for p in range(4) for h in (0, 1)])]
        assert got == want.tolist()


def test_mxfp4_with_a_scale_past_f16_stays_stored():
    """An e8m0 exponent above 128 has no finite f16 scale 2^(e - 113): such experts keep the stored layout."""
    qt = get_format("mxfp4").quantize(RNG.standard_normal((2, 64, 64)).astype(np.float32))
    assert mma_pack.packable(qt)
    blocks = qt.arrays["blocks"].copy()
    blocks.reshape(-1, 17)[3, 0] = 129
    assert not mma_pack.packable(dataclasses.replace(qt, arrays={"blocks": blocks}))


def packed_case(fmt, T, N, K, block_m, reverse=False, E=4, A=2):
    """A repacking test's case: E experts after a hidden one (contiguous arrays), top-A routing of T tokens, GEMM1
    and GEMM2 inputs, the natural and gate/up-halves packs, and run(w, a, **kw): moe_gemm_mma on the upper-bound
    layout of block_m."""
    rt = EmuDevice(reverse=reverse)  # a block's threads in reverse order: a missing barrier shows
    ids, tw = routing(T, E, A)
    qt = experts_after_a_hidden_one(fmt, E, N, K)
    qt = dataclasses.replace(qt, arrays={k: np.ascontiguousarray(a) for k, a in qt.arrays.items()})
    s_, e_ = upper_bound_layout(EmuDevice(), ids, E, block_m)
    x, xs = RNG.standard_normal((T, K)).astype(np.float32), RNG.standard_normal((T * A, K)).astype(np.float32)
    run = lambda w, a, **kw: run_on(rt, run_moe_gemm, a, w, s_, e_, block_m, A, kind="mma", **kw)  # noqa: E731
    return types.SimpleNamespace(qt=qt, ids=ids, tw=tw, x=x, xs=xs, A=A, E=E, run=run, natural=mma_pack.pack(qt),
                                 halves=mma_pack.pack(qt, halves=True))


@pytest.mark.parametrize("fmt,order", [*((f, "forward") for f in PACK_FORMATS + GGML_PACK_FORMATS),
                                       ("int3-g64", "reverse"), ("q5_1", "reverse")])
@pytest.mark.parametrize("T,block_m,split", [(1, 16, None), (30, 64, None), (5, 16, 3)])
def test_packed_codes_give_identical_products(fmt, order, T, block_m, split):
    """The packed layout changes where codes are read from, not the values: bit-identical to the stored layout's
    decoder (affine: the same f16 arithmetic; GGML: the stored decoder's f32 weight rounded to f16 once, here by
    one f16x2 multiply or FMA), for GEMM1 (natural tiles; gate/up halves with and without the fused silu) and
    GEMM2. A block's threads in reverse order (a missing barrier shows) for two decoders: the loop is theirs in common."""
    c = packed_case(fmt, T, 128, 256, block_m, reverse=order == "reverse")
    qt, tw, x, xs, natural, halves, run = c.qt, c.tw, c.x, c.xs, c.natural, c.halves, c.run
    base = run(qt, x, split=split)
    assert_close(run(natural, x, split=split), base, exact=True, what="GEMM1, natural tiles")
    assert_close(run(halves, x, split=split), base, exact=True, what="GEMM1, gate/up halves")
    assert_close(run(halves, x, silu=True), run(qt, x, silu=True), exact=True, what="GEMM1 + silu")
    assert_close(run(natural, xs, topk_weights=tw, x_is_slots=True, split=split),
                 run(qt, xs, topk_weights=tw, x_is_slots=True, split=split), exact=True, what="GEMM2")


@pytest.mark.parametrize("fmt", PACK_FORMATS + GGML_PACK_FORMATS)
@pytest.mark.parametrize("split", [1, 2])
def test_packed_rings_wrap_over_many_k_tiles(fmt, split):
    """14 k-tiles of 64 (K = 896): every ring of codes (2-6 tiles ahead) wraps at least twice, the activation stage
    of a tile is its place in the unrolled ring (decode, block_m 16), the last pass ends short (int2, int3, the 4-bit
    and 5-bit codes), and split in 2 each chunk of 7 tiles ends mid-pass: bit-identical to the stored layout's
    decoder, GEMM1 and GEMM2."""
    c = packed_case(fmt, 3, 64, 896, 16)
    qt, tw, x, xs, packed, run = c.qt, c.tw, c.x, c.xs, c.natural, c.run
    assert_close(run(packed, x, split=split), run(qt, x, split=split), exact=True, what="GEMM1")
    assert_close(run(packed, xs, topk_weights=tw, x_is_slots=True, split=split),
                 run(qt, xs, topk_weights=tw, x_is_slots=True, split=split), exact=True, what="GEMM2")


KQUANT_PACK_FORMATS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


def _kquant_sides(qt):
    """(codes [E, N, K], scale f16, bias f16 or None [E, N, K / group]) of a k-quant QTensor, from kquant.fields (the
    layout the GGUF oracle checks), computed here apart from mma_pack: d * sc and -dmin * m rounded to f16."""
    from toolkit.formats.kquant import fields

    E, N, K = qt.shape
    f = fields(qt.fmt.name, qt.arrays["blocks"])
    d = f.d.view(np.float16).astype(np.float32)[:, None]
    s = (d * f.sc).astype(np.float16).reshape(E, N, -1)
    b = None if f.m is None else (-(f.dmin.view(np.float16).astype(np.float32)[:, None] * f.m)).astype(np.float16)
    return f.codes.reshape(E, N, K), s, None if b is None else b.reshape(s.shape)


@pytest.mark.parametrize("fmt", KQUANT_PACK_FORMATS)
@pytest.mark.parametrize("halves", [False, True])
def test_kquants_repack_to_f16_group_scales(fmt, halves):
    """q3_K / q4_K / q5_K / q6_K repack to the codes of int3 / int4 / q5_1 / 6-bit (int4's nibbles and 2-bit words)
    and one f16 scale (and bias) a group of 16 / 32 / 32 / 16; q2_K to int2's codes beside its factor bytes and
    (d, -dmin) words, from which the kernel makes the same f16 products (side_values: as the kernel makes them):
    d * sc (and -dmin * m) rounded once, each weight then within that rounding of the stored one (the declared
    bound: |q - off| half an f16 ulp of the scale, plus half an ulp of the bias); q4_K's arrays are exactly those of
    the int4-g32 tensor with the same codes, scales and biases (the kernel, group and all, is that one's)."""
    w = RNG.standard_normal((2, 128, 512)).astype(np.float32) * 0.05
    w[1, 3, :256] = 0.0  # an all-zero super-block
    qt = get_format(fmt).quantize(w)
    packed = mma_pack.pack(qt, halves)
    assert set(packed.arrays) == set(mma_pack.array_specs(packed))
    for name, (dtype, shape) in mma_pack.array_specs(packed).items():
        assert packed.arrays[name].dtype == dtype and packed.arrays[name].shape == shape, name
    codes, s, b = _kquant_sides(qt)
    assert_close(mma_pack.ggml_codes(packed), codes, exact=True, what="codes")
    got_s, got_b = mma_pack.side_values(packed)
    assert_close(got_s, s, exact=True, what="scales")
    assert (got_b is None) == (b is None)
    if b is not None:
        assert_close(got_b, b, exact=True, what="biases")
    group, off = mma_pack.KQUANTS[fmt].group, mma_pack.KQUANTS[fmt].off
    half_ulp = lambda h: np.repeat(np.spacing(np.abs(h)).astype(np.float32) / 2, group, axis=-1)  # noqa: E731
    bound = np.abs(codes.astype(np.float32) - off) * half_ulp(s) + (0 if b is None else half_ulp(b))
    err = np.abs(mma_pack.dequantize(packed) - qt.dequantize())
    assert (err <= bound * (1 + 1e-6) + 1e-12).all(), float((err - bound).max())
    assert err.max() > 0  # the scales' rounding does show (a pack that kept them in f32 would not be this one)
    E, N, K = qt.shape
    assert packed.nbytes == E * N * K * (mma_pack.code_bits(qt.fmt) + mma_pack.side_bits(qt.fmt)) // 8
    if fmt == "q4_k":
        twin = get_format("int4-g32").quantize(w)
        twin = dataclasses.replace(twin, arrays={"qweight": mma_pack._affine_bytes(codes, 4), "scales": s, "biases": b})
        want = mma_pack.pack(twin, halves)
        assert set(want.arrays) == set(packed.arrays)
        for k in want.arrays:
            assert_close(packed.arrays[k], want.arrays[k], exact=True, what=k)
        assert mma_pack.decoder(qt.fmt) == mma_pack.decoder(twin.fmt)
        assert mma_pack.side_group(qt.fmt) == twin.fmt.group_size


@pytest.mark.parametrize("fmt", KQUANT_PACK_FORMATS)
def test_kquants_with_a_scale_past_f16_stay_stored(fmt):
    """A super-block's d or dmin above KQUANT_MAX_D could make d * sc an f16 infinity: such experts keep the stored
    layout (and their stored decoder), as does a NaN d."""
    from toolkit.formats.kquant import SPECS

    qt = get_format(fmt).quantize(RNG.standard_normal((2, 64, 256)).astype(np.float32))
    assert mma_pack.packable(qt)
    for at in SPECS[fmt].halves:
        for bad in (2000.0, np.nan):
            blocks = qt.arrays["blocks"].copy()
            blocks.reshape(-1, SPECS[fmt].bytes)[1, at:at + 2] = np.frombuffer(np.float16(bad).tobytes(), np.uint8)
            assert not mma_pack.packable(dataclasses.replace(qt, arrays={"blocks": blocks})), (at, bad)


@pytest.mark.parametrize("fmt,packs", [("q2_k", False), ("q3_k", True), ("q4_k", True)])
def test_q2k_keeps_d_where_its_bias_is_finite(fmt, packs):
    """q2_K's kernel makes the bias -1024 * (d, -dmin) once a super-block (formats.cuh Q2_KPackedDec): a d or dmin of
    100 (finite products d * sc for every k-quant, KQUANT_MAX_D) keeps q2_K in its stored layout; 63 packs."""
    from toolkit.formats.kquant import SPECS

    qt = get_format(fmt).quantize(RNG.standard_normal((2, 64, 256)).astype(np.float32))
    for at in SPECS[fmt].halves:
        for v, ok in ((100.0, packs), (63.0, True)):
            blocks = qt.arrays["blocks"].copy()
            blocks.reshape(-1, SPECS[fmt].bytes)[1, at:at + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
            assert mma_pack.packable(dataclasses.replace(qt, arrays={"blocks": blocks})) == ok, (at, v)


@pytest.mark.parametrize("fmt", KQUANT_PACK_FORMATS)
@pytest.mark.parametrize("T,block_m,split,K", [(1, 16, None, 256), (30, 64, None, 256), (5, 16, 2, 1024),
                                               (2, 16, 1, 1024), (2, 16, 3, 1024)])
def test_packed_kquants_make_the_products_of_their_f16_weights(fmt, T, block_m, split, K):
    """moe_gemm_mma on repacked k-quants: GEMM1 and GEMM2 against the reference on the packed weights rounded to f16
    (MMA_TOL: f32 summation order only) and against the stored tensor's f32 reference (ROUNDING_TOL); gate/up
    halves and the fused silu give the natural tiles' products exactly. K = 1024 (16 k-tiles) wraps every ring
    (q2_K's 12 tiles unsplit) and splits mid-pass; split 3 would start a chunk mid-super-block (6 k-tiles), which
    q2_K's launch rounds to whole super-blocks (k_align)."""
    c = packed_case(fmt, T, 128, K, block_m)
    qt, ids, tw, x, xs, natural, halves, run, A = c.qt, c.ids, c.tw, c.x, c.xs, c.natural, c.halves, c.run, c.A
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, c.E, block_m)
    for what, a, kw in [("GEMM1", x, {}), ("GEMM2", xs, dict(topk_weights=tw, x_is_slots=True))]:
        got = run(natural, a, split=split, **kw)
        want = rounded_reference(a, natural, ids, kw.get("topk_weights"), A, "f16", bool(kw))
        assert_close(got, want, **MMA_TOL, what=f"{what} vs the packed f16 weights")
        plain = get_op("moe_gemm", "numpy")(a, qt, sorted_ids, expert_ids, block_m, A, kw.get("topk_weights"),
                                            x_is_slots=bool(kw))
        assert_close(got, plain, **ROUNDING_TOL["f16"], what=f"{what} vs f32")
    assert_close(run(halves, x, split=split), run(natural, x, split=split), exact=True, what="gate/up halves")
    silu_of = get_op("silu_and_mul", "numpy")(run(natural, x, split=1))  # [T, N / 2]: gate rows first, then up
    assert_close(run(halves, x, silu=True), silu_of, **INSTR_TOL, what="GEMM1 + fused silu")


WIDE_FORMATS = ["int8", "int4-g128", "int3-g64", "int2-g64", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "q3_k",
                "q6_k", "q2_k"]
# those decoded into a tile at block_m 128, their codes loaded into registers a sub-tile ahead and prefetched into L2
# 3 tiles ahead (moe_gemm_mma.cu T::WIDE): run at 4 k-tiles (K 256), so that neither is only the clamp to the last
WIDE_DECODED = ("int3-g64", "int2-g64", "q5_1", "q3_k", "q6_k", "q2_k")


@pytest.mark.parametrize("fmt,T,order,K", [("int8", 150, "reverse", 128), ("int4-g128", 150, "forward", 128),
                                           ("q8_0", 150, "reverse", 128),
                                           ("int8", 7, "forward", 160),
                                           *((f, 7, "forward", 256 if f.endswith("_k") or f in WIDE_DECODED else 128)
                                             for f in WIDE_FORMATS[2:] if f != "q5_0")])
def test_wide_tiles_give_the_64_token_products(fmt, T, order, K):
    """block_m 128 (128 weight rows x 128 tokens a block, 4 warps of 64 x 64, 72 KB of dynamic shared memory) makes
    each output from the same chain of MMAs over K as block_m 64: bit-identical, for GEMM1 (natural tiles, gate/up
    halves with and without the fused silu, which pairs gate and up rows in one thread's registers) and GEMM2, with
    N = 192 (a block whose second 64-row sub-tile is past the weight), several 128-token blocks of one expert (T =
    150: int8, int4, q8_0; the emulation of a 128-thread block is slow) or one part-filled (T = 7: each packed
    decoder but q5_0, which shares q5_1's code; q4_1 is int4's at groups of 32, two sides a k-tile; q2_K, q3_K and
    q6_K at K = 256, their super-block, and the other decoded formats too: WIDE_DECODED); int8 as stored, the others packed as the model uploads them; int8 also at
    K = 160 (a last k-tile of 32: its codes' copies zero-fill past K). K split in 2 too (each part's k-tiles from its
    own start, the codes of one part's last tile copied again past its end)."""
    rt = EmuDevice(reverse=order == "reverse")  # a block's threads in reverse order: a missing barrier shows
    E, A, N = 4, 2, 192
    ids, tw = routing(T, E, A)
    qt = experts_after_a_hidden_one(fmt, E, N, K)
    qt = dataclasses.replace(qt, arrays={k: np.ascontiguousarray(a) for k, a in qt.arrays.items()})
    packs = [qt] if fmt == "int8" else [mma_pack.pack(qt), mma_pack.pack(qt, halves=True)]
    x, xs = RNG.standard_normal((T, K)).astype(np.float32), RNG.standard_normal((T * A, K)).astype(np.float32)
    layout = {bm: upper_bound_layout(EmuDevice(), ids, E, bm) for bm in (64, 128)}

    def run(bm, w, a, split=1, **kw):
        return run_on(rt, run_moe_gemm, a, w, *layout[bm], bm, A, kind="mma", split=split, **kw)

    for w in packs:
        assert_close(run(128, w, x), run(64, w, x), exact=True, what=f"GEMM1, {mma_pack.packing(w)}")
        assert_close(run(128, w, x, split=2), run(64, w, x, split=2), exact=True, what=f"GEMM1 split 2, {mma_pack.packing(w)}")
        assert_close(run(128, w, xs, topk_weights=tw, x_is_slots=True), run(64, w, xs, topk_weights=tw, x_is_slots=True),
                     exact=True, what=f"GEMM2, {mma_pack.packing(w)}")
    silu_w = packs[-1]
    assert_close(run_on(rt, run_moe_gemm, x, silu_w, *layout[128], 128, A, kind="mma", silu=True),
                 run_on(rt, run_moe_gemm, x, silu_w, *layout[64], 64, A, kind="mma", silu=True), exact=True,
                 what="GEMM1 + silu")
    ref_w = packs[0] if fmt in KQUANT_PACK_FORMATS else qt  # a k-quant's f16 weights are its packed ones
    assert_close(run(128, packs[0], x), rounded_reference(x, ref_w, ids, None, A, "f16", False), **MMA_TOL,
                 what="GEMM1 vs rounded operands")


def test_wide_tiles_are_built_for_what_the_model_path_gives_them():
    """128-token blocks where both GEMMs have the kernel (fused_moe's choice on an sm_90 device), 64 otherwise, and a
    clear refusal of a format without it."""
    from toolkit.gpu.moe_gemm_mma import has_wide

    rt = EmuDevice(arch=900)
    E, N, K = 4, 128, 256
    w = {f: get_format(f).quantize(RNG.standard_normal((E, N, K)).astype(np.float32)) for f in ("int4-g64", "q4_k", "fp8")}
    assert has_wide(rt, mma_pack.pack(w["int4-g64"])) and not has_wide(rt, w["int4-g64"])  # stored int4: 64 at most
    assert not has_wide(rt, w["q4_k"]) and not has_wide(EmuDevice(), mma_pack.pack(w["int4-g64"]))
    assert has_wide(rt, w["fp8"])  # on wgmma (tests/test_cuda_wgmma.py)
    assert block_m_for(8192, 8, wide=True) == 128 and block_m_for(8192, 8) == 64 and block_m_for(700, 8, wide=True) == 64
    ids, _ = routing(3, E, 2)
    s_, e_ = upper_bound_layout(EmuDevice(), ids, E, 128)
    with pytest.raises(BackendError, match=r"no MMA instantiation moe_gemm_mma<Q4_KDec, OpF16, 128>"):
        run_moe_gemm(rt, RNG.standard_normal((3, K)).astype(np.float32), w["q4_k"], s_, e_, 128, 2, kind="mma")


class LaunchSpy(EmuDevice):
    """The emulated device, keeping (stem, kernel, dynamic shared memory) of every moe_gemm launch in ``picked``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.picked = []

    def launch(self, stem, kernel, grid, block, args, shared_mem=0):
        if kernel.startswith("moe_gemm_"):
            self.picked.append((stem, kernel, shared_mem))
        super().launch(stem, kernel, grid, block, args, shared_mem)


@pytest.mark.parametrize("packed", [True, False])
def test_fused_moe_takes_wide_tiles_at_prefill(packed):
    """ops.fused_moe on an sm_90 device: 128-token blocks once the experts fill them, only where both GEMMs have that
    kernel (int4 packed at upload: yes; as stored: no, 64), and the layer's result is the 64-token one."""
    from toolkit.gpu.ops import DeviceOps

    E, A, D, I, T = 2, 2, 128, 128, 200  # 400 slots over 2 experts: 200 a block of 128 fills most
    ids, tw = routing(T, E, A)
    f = get_format("int4-g64")
    gate_up = f.quantize(RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1)
    down = f.quantize(RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1)
    if packed:
        gate_up, down = mma_pack.pack(gate_up, halves=True), mma_pack.pack(down)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    rt = LaunchSpy(arch=900)
    got = run_on(rt, lambda dev, *a: DeviceOps(dev).fused_moe(*a), x, tw, ids, gate_up, down)
    bm = 128 if packed else 64
    picked = [(k, smem) for stem, k, smem in rt.picked if k.startswith("moe_gemm_mma<")]
    assert {k.rstrip(">").rsplit(", ", 1)[1] for k, _ in picked} == {str(bm)}, picked
    assert all(smem == (64512 if packed else 0) for _, smem in picked), picked  # 3 stages of 128 x (128 + 32) + 1 KB
    want = run_on(EmuDevice(arch=900), run_fused_moe, x, tw, ids, gate_up, down, 64)
    assert_close(got, want, exact=True)


def test_packed_codes_are_refused_where_they_cannot_be_read():
    E, A, N, K = 2, 2, 64, 128
    ids, _ = routing(3, E, A)
    qt = get_format("int4-g64").quantize(RNG.standard_normal((E, N, K)).astype(np.float32))
    s_, e_ = upper_bound_layout(EmuDevice(), ids, E, 16)
    x = RNG.standard_normal((3, K)).astype(np.float32)
    with pytest.raises(BackendError, match="packed for the tensor-core kernel"):
        run_moe_gemm(EmuDevice(), x, mma_pack.pack(qt), s_, e_, 16, A, kind="tiled")
    with pytest.raises(BackendError, match="silu needs gate_up packed with halves"):
        run_moe_gemm(EmuDevice(), x, mma_pack.pack(qt), s_, e_, 16, A, kind="mma", silu=True)


def test_upload_packs_routed_experts_for_tensor_cores_only():
    from toolkit.gpu.ops import upload_qtensor

    class Dev:
        def __init__(self, arch):
            self.arch = arch

        to_device = staticmethod(np.asarray)

    qt = get_format("int4-g64").quantize(RNG.standard_normal((2, 128, 128)).astype(np.float32))
    assert mma_pack.packing(upload_qtensor(Dev(900), qt, "moe.gate_up")) == "halves"
    assert mma_pack.packing(upload_qtensor(Dev(900), qt, "moe.down")) == "natural"
    assert mma_pack.packing(upload_qtensor(Dev(900), qt, "attn.q")) is None  # qlinear reads the stored layout
    assert mma_pack.packing(upload_qtensor(Dev(750), qt, "moe.down")) is None  # no tensor cores

    class Gpu(Dev):  # a device with a stream packs after the upload, on the device's arrays, on its stream
        stream = contextlib.nullcontext()
        uploads = []

        def to_device(self, a):
            self.uploads.append(a.dtype)
            return np.asarray(a)

    for fmt in ("int4-g64", "q4_0"):
        qt = get_format(fmt).quantize(RNG.standard_normal((2, 128, 128)).astype(np.float32))
        gpu, host = upload_qtensor(Gpu(900), qt, "moe.gate_up"), mma_pack.pack(qt, halves=True)
        assert set(gpu.arrays) == set(host.arrays) and all(np.array_equal(gpu.arrays[k], host.arrays[k]) for k in host.arrays)
    assert Gpu.uploads[-1] == np.uint8  # what went up was the stored blocks


@pytest.mark.parametrize("T", [1, 40])
def test_fused_moe_with_packed_experts(T):
    rt = EmuDevice(arch=900)
    E, A, D, I = 4, 2, 128, 192
    ids, tw = routing(T, E, A)
    f = get_format("int4-g64")
    gate_up = f.quantize(RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1)
    down = f.quantize(RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    block_m = block_m_for(T * A, E)
    want = run_on(rt, run_fused_moe, x, tw, ids, gate_up, down, block_m)
    got = run_on(rt, run_fused_moe, x, tw, ids, mma_pack.pack(gate_up, halves=True), mma_pack.pack(down), block_m)
    assert_close(got, want, exact=True)


def test_split_k_sum_is_a_kernel_a_recorded_step_replays():
    """On the emulated device (arrays the host cannot touch), the split-K partials are summed by a kernel: a
    recorded step replayed on new activations gives the eager result (a host-side sum would not be replayed)."""
    from toolkit.gpu.device import Plan

    dev = EmuDevice()
    T, E, A, N, K = 2, 4, 2, 64, 1024
    ids, _ = routing(T, E, A)
    w = get_format("int4-g128").quantize(RNG.standard_normal((E, N, K)).astype(np.float32) * 0.1)
    wd = dataclasses.replace(w, arrays={k: dev.to_device(a) for k, a in w.arrays.items()})
    s_, e_ = upper_bound_layout(EmuDevice(), ids, E, 16)
    sd, ed = dev.to_device(s_), dev.to_device(e_)
    x = dev.to_device(RNG.standard_normal((T, K)).astype(np.float32))
    plan = Plan()
    with dev.recording(plan):
        out = run_moe_gemm(dev, x, wd, sd, ed, 16, A, kind="mma", split=4)
    assert len(plan.steps) >= 3  # to_op, the GEMM, splitk_sum (and the memsets of fresh buffers)
    x2 = RNG.standard_normal((T, K)).astype(np.float32)
    dev.copy_in(x, x2)
    plan.replay(dev)
    want = run_on(EmuDevice(), run_moe_gemm, x2, w, s_, e_, 16, A, kind="mma", split=1)
    assert_close(dev.to_host(out), want, **MMA_TOL)
