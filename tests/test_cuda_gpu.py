"""The CUDA backend's ops on a real GPU, as the runtime calls them (``get_op(name, "cuda")``: device arrays
in, device arrays out, ``toolkit/gpu/ops.py``) against the NumPy reference, at test shapes and at Mixtral's
real shapes (D 4096, I 14336, 8 experts top-2, 32/8 heads of 128, vocab 32000). Skipped, with the reason,
where CuPy finds no device (cupy.cuda.is_available() is False); the same launch plans run emulated in
tests/test_cuda_emulated.py and tests/test_cuda_runtime_ops.py, and the whole model in tests/test_cuda_model.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close, assert_close_but_requantized, dot_tol
from toolkit.backend import cuda_unavailable_reason
from toolkit.formats import get_format
from toolkit.ops import get_op

pytestmark = pytest.mark.skipif(cuda_unavailable_reason() is not None, reason=str(cuda_unavailable_reason()))
RNG = np.random.default_rng(0)
TOL = dict(atol=2e-5, rtol=2e-5)
MIXTRAL = dict(D=4096, I=14336, E=8, A=2, H=32, Hkv=8, hd=128, V=32000)


@pytest.fixture(scope="module")
def dev():
    from toolkit.gpu.device import device

    return device("cuda")


def on(dev, *arrays):
    return [dev.to_device(np.ascontiguousarray(a)) for a in arrays]


def both(name):
    return get_op(name, "numpy"), get_op(name, "cuda")


@pytest.mark.parametrize("T,E,A", [(1, 8, 2), (64, 8, 2), (5, 60, 4), (4096, 8, 2)])
def test_topk_softmax(dev, T, E, A):
    ref, gpu = both("topk_softmax")
    x = RNG.standard_normal((T, E)).astype(np.float32)
    (wr, ir), (w, i) = ref(x, A, True), gpu(*on(dev, x), A, True)
    assert_close(dev.to_host(i), ir, exact=True)
    assert_close(dev.to_host(w), wr, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T,E,A,G,TG", [(1, 256, 8, 8, 4), (4096, 256, 8, 8, 4), (64, 160, 6, 8, 3)])
def test_grouped_routers(dev, T, E, A, G, TG):
    x = RNG.standard_normal((T, E)).astype(np.float32)
    b = (RNG.standard_normal(E) * 0.2).astype(np.float32)
    ref, gpu = both("topk_sigmoid")
    (wr, ir), (w, i) = ref(x, b, A, G, TG, True, 2.5), gpu(*on(dev, x, b), A, G, TG, True, 2.5)
    assert_close(dev.to_host(i), ir, exact=True)
    assert_close(dev.to_host(w), wr, atol=1e-6, rtol=1e-5)
    ref, gpu = both("topk_softmax_grouped")
    (wr, ir), (w, i) = ref(x, A, G, TG, 1.5), gpu(*on(dev, x), A, G, TG, 1.5)
    assert_close(dev.to_host(i), ir, exact=True)
    assert_close(dev.to_host(w), wr, atol=1e-6, rtol=1e-5)


def _experts(fmt, E, I, D):
    f = get_format(fmt)
    backend = "numba" if "numba" in f.codecs else "numpy"
    gu = f.quantize(RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.05, backend)
    dn = f.quantize(RNG.standard_normal((E, D, I)).astype(np.float32) * 0.05, backend)
    return gu, dn


def _layer(fmt, T, I, E=8, A=2, D=256):
    """A fused MoE layer's inputs: x [T, D], routing weights and ids [T, A], experts [E, 2I, D] and [E, D, I]."""
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    tw = RNG.random((T, A)).astype(np.float32)
    gu, dn = _experts(fmt, E, I, D)
    return RNG.standard_normal((T, D)).astype(np.float32), tw, ids, gu, dn


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4", "int3", "int2", "q8_0", "q4_0", "mxfp4"])
@pytest.mark.parametrize("T", [1, 64, 512])  # 512: 128 slots an expert, 128-token tiles where the kernel has them
@pytest.mark.parametrize("routed", [False, True])  # True: uploaded as routed experts (repacked on the GPU)
def test_fused_moe(dev, fmt, T, routed):
    from toolkit.gpu.ops import upload_qtensor

    ref, gpu = both("fused_moe")
    x, tw, ids, gu, dn = _layer(fmt, T, 384)
    tol = dict(atol=1e-2, rtol=1e-2) if fmt == "fp8" else dict(atol=1e-4, rtol=1e-4)
    if getattr(dev, "arch", 0) >= 800:  # tensor cores (moe_gemm_mma): f16 operands, 2^-11 relative each
        tol = dict(atol=1e-2, rtol=1e-2)
    roles = ("moe.gate_up", "moe.down") if routed else (None, None)
    got = gpu(*on(dev, x, tw, ids), upload_qtensor(dev, gu, roles[0]), upload_qtensor(dev, dn, roles[1]))
    if fmt == "fp8" and T == 512 and getattr(dev, "arch", 0) == 900:  # wgmma: its 13-bit sums move a few codes of h
        assert_close_but_requantized(dev.to_host(got), ref(x, tw, ids, gu, dn), tol=2.0**-9, stray=0.03,
                                     stray_frac=0.05, what="fp8 on wgmma (tests/test_cuda_wgmma.py's bounds)")
        return
    assert_close(dev.to_host(got), ref(x, tw, ids, gu, dn), **tol)


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("T", [1, 64])
def test_fused_moe_kquants_repacked_on_the_gpu(dev, fmt, T):
    """k-quant experts uploaded as routed experts: their blocks go up as stored and are taken apart and repacked by
    CuPy on the GPU (kquant.fields on device arrays); the layer within the f16 operands' and scales' rounding of the
    reference, and the device's packed arrays those the host packs."""
    from toolkit.gpu import mma_pack
    from toolkit.gpu.ops import upload_qtensor

    ref, gpu = both("fused_moe")
    x, tw, ids, gu, dn = _layer(fmt, T, 512)  # I a whole number of super-blocks
    gu_d, dn_d = upload_qtensor(dev, gu, "moe.gate_up"), upload_qtensor(dev, dn, "moe.down")
    assert mma_pack.packing(gu_d) == "halves" and mma_pack.packing(dn_d) == "natural"
    host = mma_pack.pack(dn)
    assert all(np.array_equal(dev.to_host(dn_d.arrays[k]), host.arrays[k]) for k in host.arrays)
    got = gpu(*on(dev, x, tw, ids), gu_d, dn_d)
    assert_close(dev.to_host(got), ref(x, tw, ids, gu, dn), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["mma", "mma-packed", "splitk", "tiled"])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4-g128", "q4_0", "mxfp4"])
@pytest.mark.parametrize("T", [1, 16])
def test_moe_gemm_mixtral_shape(dev, fmt, T, kind):
    """GEMM1 at Mixtral's real shape (8 experts of [28672, 4096], top-2) on random valid codes, against the
    Numba kernel (itself tested against the NumPy reference at small shapes); every kernel kind (mma: tensor
    cores with f16 operands, or e4m3 for fp8; checked relative to the largest output)."""
    import dataclasses

    import cupy

    from toolkit.bench.cuda import random_qtensor
    from toolkit.gpu.moe_align import run_moe_align
    from toolkit.gpu.moe_gemm import run_moe_gemm

    m = MIXTRAL
    E, A, D, I = m["E"], m["A"], m["D"], m["I"]
    with dev.stream:  # made on the device (1 GB of int8 codes: seconds with NumPy), on the device's stream
        cupy.random.seed(0)
        w_dev = random_qtensor(dev.xp, get_format(fmt), (E, 2 * I, D))  # [E, 2I, D]
    w = dataclasses.replace(w_dev, arrays={k: dev.to_host(a) for k, a in w_dev.arrays.items()})  # the reference's
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, 16)
    want = get_op("moe_gemm", "numba")(x, w, sorted_ids, expert_ids, 16, A)
    s_d, e_d, _ = run_moe_align(dev, *on(dev, ids), E, 16)
    if kind.startswith("mma") and fmt == "fp8" and dev.arch < 890:
        pytest.skip(f"e4m3 MMA needs sm_89+, this GPU is sm_{dev.arch // 10}")
    if kind == "mma-packed":  # the codes repacked on the GPU (mma_pack on CuPy arrays), as routed experts go up
        from toolkit.gpu import mma_pack

        if not mma_pack.packable(w_dev):
            pytest.skip(f"{fmt} is not repacked")
        with dev.stream:
            w_dev = mma_pack.pack(w_dev)
        kind = "mma"
    got = dev.to_host(run_moe_gemm(dev, *on(dev, x), w_dev, s_d, e_d, 16, A, kind=kind))
    if kind == "mma" and fmt != "fp8":
        assert np.abs(got - want).max() <= 4e-3 * np.abs(want).max(), "beyond f16 operand rounding"
        return
    if kind == "tiled" and fmt != "fp8" and dev.arch >= 800:  # 3xTF32 on the tensor cores (TcTile in moe_gemm.cu)
        # their f32 accumulation truncates, about 2^-23 of the running sum per k-step of 8, always the same way:
        # 6.2e-5 of max|out| measured at K 4096 (int8, H200); the bound is 4x that model
        bound = 4 * (D / 8) * 2.0**-23 * np.abs(want).max()
        err = np.abs(got - want).max()
        assert err <= bound, f"beyond 3xTF32 accumulation: {err:.3g} > {bound:.3g}"
        return
    tol = dict(atol=5e-2, rtol=5e-2) if fmt == "fp8" else dict(atol=2e-3, rtol=2e-3)
    assert_close(got, want, **tol)


@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_fp8_prefill_on_wgmma(dev, gemm):
    """fp8 experts at prefill on sm_90: 512 tokens top-2 over 8 experts (128 slots each on average: whole and part
    128-token blocks), Mixtral's K (4096, and 14336 for down) on a slice of 256 weight rows, through moe_gemm_wgmma
    (block_m 128) against moe_gemm_mma (block_m 64) on the same device and the Numba kernel, within 1e-3 of the
    largest output: Hopper's fp8 wgmma sums with 13 bits of mantissa, so the kernel adds each k-tile's sum in f32
    (by the emulator's model 1.3e-4 of max|out| at K 4096; 2.7e-3 if the wgmmas add up all of K, as the first form
    of the kernel did: this test failed on an H100 then, 2026-12-06)."""
    import dataclasses

    import cupy

    from toolkit.bench.cuda import random_qtensor
    from toolkit.gpu.moe_align import run_moe_align
    from toolkit.gpu.moe_gemm import run_moe_gemm

    if dev.arch != 900:
        pytest.skip(f"wgmma needs sm_90, this GPU is sm_{dev.arch // 10}")
    E, A, T, N = 8, 2, 512, 256
    K = 4096 if gemm == "gate_up" else 14336
    with dev.stream:
        cupy.random.seed(1)
        w_dev = random_qtensor(dev.xp, get_format("fp8"), (E, N, K))
    w = dataclasses.replace(w_dev, arrays={k: dev.to_host(a) for k, a in w_dev.arrays.items()})
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    rows = T if gemm == "gate_up" else T * A
    x = RNG.standard_normal((rows, K)).astype(np.float32)
    tw = None if gemm == "gate_up" else RNG.random((T, A)).astype(np.float32)
    kw = dict(x_is_slots=gemm == "down", kind="mma")
    got = {}
    for bm in (128, 64):
        s_d, e_d, _ = run_moe_align(dev, *on(dev, ids), E, bm)
        args = [*on(dev, x), w_dev, s_d, e_d, bm, A] + ([] if tw is None else on(dev, tw))
        got[bm] = dev.to_host(run_moe_gemm(dev, *args, **kw))
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, 16)
    want = get_op("moe_gemm", "numba")(x, w, sorted_ids, expert_ids, 16, A, tw, x_is_slots=gemm == "down")
    for other, name in ((got[64], "mma.sync"), (want, "Numba")):
        err = np.abs(got[128] - other).max() / np.abs(other).max()
        assert err <= 1e-3, f"wgmma vs {name}: {err:.3g} of max|out|"


@pytest.mark.parametrize("T,D", [(1, 8), (33, 4096)])
def test_rms_norm_silu(dev, T, D):
    x = RNG.standard_normal((T, D)).astype(np.float32)
    w = RNG.standard_normal(D).astype(np.float32)
    ref, gpu = both("rms_norm")
    assert_close(dev.to_host(gpu(*on(dev, x, w), 1e-5)), ref(x, w, 1e-5), **TOL)
    ref, gpu = both("silu_and_mul")
    assert_close(dev.to_host(gpu(*on(dev, x))), ref(x), **TOL)


@pytest.mark.parametrize("B,T,H,hd", [(1, 1, 32, 128), (2, 17, 8, 64)])
def test_rope(dev, B, T, H, hd):
    x = RNG.standard_normal((B, T, H, hd)).astype(np.float32)
    pos = RNG.integers(0, 100_000, (B, T)).astype(np.int32)
    inv = (1.0 / 1e6 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    want = get_op("rope", "numpy")(x, pos.astype(np.int64), inv, 1.0)
    got = get_op("rope", "cuda")(*on(dev, x, pos, inv), 1.0)
    assert_close(dev.to_host(got), want, atol=1e-5 * float(np.abs(x).max()), rtol=0)


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("B,T,Hkv,hd,S", [(1, 1, 8, 128, 64), (2, 33, 2, 64, 40)])
def test_kv_store(dev, fmt, B, T, Hkv, hd, S):
    f = get_format(fmt)
    (spec,) = f.arrays((1, hd)).values()
    x = (RNG.standard_normal((B, T, Hkv, hd)) * 3).astype(np.float32)
    positions = np.stack([RNG.permutation(S)[:T] for _ in range(B)]).astype(np.int32)
    want = np.zeros((B, Hkv, S, spec.shape[-1]), spec.dtype)
    get_op("kv_store", "numpy")(want, f, x, positions)
    got = dev.zeros(want.shape, want.dtype)
    get_op("kv_store", "cuda")(got, f, *on(dev, x, positions))
    assert_close(dev.to_host(got), want, exact=True, what=f"{fmt} cache bytes")


@pytest.mark.parametrize("kf,vf", [("f32", "f32"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0")])
@pytest.mark.parametrize("B,T,H,Hkv,hd,S,start,window", [(1, 1, 32, 8, 128, 4096, 4000, 0), (2, 16, 8, 2, 64, 64, 0, 0),
                                                         (1, 1, 32, 8, 128, 1024, 1000, 5), (1, 1, 32, 8, 128, 4096, 3, 0)])
def test_kv_attention(dev, kf, vf, B, T, H, Hkv, hd, S, start, window):
    """Planned from the capacity (max_keys = S) as the runtime plans it: at position 3 of 4096 most splits are empty."""
    k_fmt, v_fmt = get_format(kf), get_format(vf)
    stores = []
    for f in (k_fmt, v_fmt):
        (spec,) = f.arrays((1, hd)).values()
        st = np.zeros((B, Hkv, S, spec.shape[-1]), spec.dtype)
        get_op("kv_store", "numpy")(st, f, RNG.standard_normal((B, S, Hkv, hd)).astype(np.float32),
                                    np.arange(S, dtype=np.int32)[None].repeat(B, 0))
        stores.append(st)
    q = RNG.standard_normal((B, T, H, hd)).astype(np.float32)
    positions = (start + np.arange(T, dtype=np.int32))[None].repeat(B, 0)
    scale = 1 / np.sqrt(hd)
    want = get_op("kv_attention", "numpy")(q, *stores, k_fmt, v_fmt, positions, scale, window)
    qd, kd, vd, pd = on(dev, q, *stores, positions)
    got = get_op("kv_attention", "cuda")(qd, kd, vd, k_fmt, v_fmt, pd, scale, window)
    prefill_on_tensor_cores = getattr(dev, "arch", 0) >= 800 and T * H // Hkv >= 16  # kv_attention_mma: f16 products
    tol = dict(atol=4e-3, rtol=4e-3) if prefill_on_tensor_cores else dict(atol=2e-5, rtol=1e-4)
    assert_close(dev.to_host(got), want, **tol)


@pytest.mark.parametrize("M,N,K", [(1, 32000, 1024), (4, 4096, 4096), (11, 1024, 4096)])
def test_linear_kernel(dev, M, N, K):
    """The dense GEMM of a recorded decode step (cuda_src/linear.cu) at Mixtral's LM head and projections."""
    from toolkit.gpu.linear import run_linear

    a, w = RNG.standard_normal((M, K)).astype(np.float32), RNG.standard_normal((N, K)).astype(np.float32)
    out = run_linear(dev, *on(dev, a, w), dev.empty((M, N), np.float32))
    assert_close(dev.to_host(out), a @ w.T, **dot_tol(K))


@pytest.mark.parametrize("B,V", [(1, 32000), (4, 151_936)])
def test_sample_greedy_and_nll(dev, B, V):
    logits = RNG.standard_normal((B, V)).astype(np.float32) * 3
    seen = np.zeros((B, V), np.uint8)
    ids = get_op("sample", "cuda")(*on(dev, logits), 0.0, 0, 1.0, 1.0, 0, 0, dev.zeros((B, V), np.uint8))
    assert_close(dev.to_host(ids), np.argmax(logits, axis=1).astype(np.int32), exact=True)
    want = get_op("sample", "numpy")(logits, 0.8, 40, 0.9, 1.2, 5, 3, seen.copy())
    got = get_op("sample", "cuda")(*on(dev, logits), 0.8, 40, 0.9, 1.2, 5, 3, dev.zeros((B, V), np.uint8))
    assert_close(dev.to_host(got), np.asarray(want, np.int32), exact=True)
    targets = RNG.integers(0, V, B).astype(np.int32)
    assert_close(dev.to_host(get_op("nll", "cuda")(*on(dev, logits, targets))), get_op("nll", "numpy")(logits, targets),
                 atol=2e-6, rtol=2e-6)
