"""The CUDA backend on a real GPU: each op through get_op(name, 'cuda') (CuPy RawModule) against the NumPy
reference. Skipped, with the reason, where CuPy finds no device (cupy.cuda.is_available() is False)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close
from toolkit.backend import cuda_unavailable_reason
from toolkit.formats import get_format
from toolkit.ops import get_op


pytestmark = pytest.mark.skipif(cuda_unavailable_reason() is not None, reason=str(cuda_unavailable_reason()))
RNG = np.random.default_rng(0)
TOL = dict(atol=2e-5, rtol=2e-5)


def both(name):
    return get_op(name, "numpy"), get_op(name, "cuda")


@pytest.mark.parametrize("T,E,A", [(1, 8, 2), (64, 8, 2), (5, 60, 4)])
def test_topk_softmax(T, E, A):
    ref, gpu = both("topk_softmax")
    x = RNG.standard_normal((T, E)).astype(np.float32)
    (wr, ir), (w, i) = ref(x, A, True), gpu(x, A, True)
    assert_close(i, ir, exact=True)
    assert_close(w, wr, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T,E,A,bm", [(1, 8, 2, 16), (300, 8, 2, 64)])
def test_moe_align(T, E, A, bm):
    ref, gpu = both("moe_align")
    ids = RNG.integers(0, E, (T, A)).astype(np.int32)
    (sr, er, pr), (s, e, p) = ref(ids, E, bm), gpu(ids, E, bm)
    assert p == pr
    assert_close(s, sr, exact=True)
    assert_close(e, er, exact=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4", "int3", "int2", "q8_0", "q4_0"])
@pytest.mark.parametrize("T", [1, 64])
def test_fused_moe(fmt, T):
    ref, gpu = both("fused_moe")
    E, A, D, I = 8, 2, 256, 384
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    tw = RNG.random((T, A)).astype(np.float32)
    f = get_format(fmt)
    gu = f.quantize(RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1)
    dn = f.quantize(RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    tol = dict(atol=1e-2, rtol=1e-2) if fmt == "fp8" else dict(atol=1e-4, rtol=1e-4)
    assert_close(gpu(x, tw, ids, gu, dn), ref(x, tw, ids, gu, dn), **tol)


@pytest.mark.parametrize("T,D", [(1, 8), (33, 4096)])
def test_rms_norm_silu_combine(T, D):
    x = RNG.standard_normal((T, D)).astype(np.float32)
    w = RNG.standard_normal(D).astype(np.float32)
    ref, gpu = both("rms_norm")
    assert_close(gpu(x, w, 1e-5), ref(x, w, 1e-5), **TOL)
    ref, gpu = both("silu_and_mul")
    assert_close(gpu(x), ref(x), **TOL)
    ref, gpu = both("moe_combine")
    assert_close(gpu(x, 1), ref(x, 1), **TOL)


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("B,T,Hkv,hd,S", [(1, 1, 8, 128, 64), (2, 33, 2, 64, 40)])
def test_kv_store(fmt, B, T, Hkv, hd, S):
    ref, gpu = both("kv_store")
    f = get_format(fmt)
    (spec,) = f.arrays((1, hd)).values()
    x = (RNG.standard_normal((B, T, Hkv, hd)) * 3).astype(np.float32)
    positions = np.stack([RNG.permutation(S)[:T] for _ in range(B)]).astype(np.int32)
    want = np.zeros((B, Hkv, S, spec.shape[-1]), spec.dtype)
    got = want.copy()
    ref(want, f, x, positions)
    gpu(got, f, x, positions)
    assert_close(got, want, exact=True, what=f"{fmt} cache bytes")


@pytest.mark.parametrize("kf,vf", [("f32", "f32"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0")])
@pytest.mark.parametrize("B,T,H,Hkv,hd,S,start,window", [(1, 1, 32, 8, 128, 4096, 4000, 0), (2, 16, 8, 2, 64, 64, 0, 0),
                                                         (1, 1, 32, 8, 128, 1024, 1000, 5)])
def test_kv_attention(kf, vf, B, T, H, Hkv, hd, S, start, window):
    store, attend = both("kv_store")[0], both("kv_attention")
    k_fmt, v_fmt = get_format(kf), get_format(vf)
    stores = []
    for f in (k_fmt, v_fmt):
        (spec,) = f.arrays((1, hd)).values()
        st = np.zeros((B, Hkv, S, spec.shape[-1]), spec.dtype)
        store(st, f, RNG.standard_normal((B, S, Hkv, hd)).astype(np.float32), np.arange(S, dtype=np.int32)[None].repeat(B, 0))
        stores.append(st)
    q = RNG.standard_normal((B, T, H, hd)).astype(np.float32)
    positions = (start + np.arange(T, dtype=np.int32))[None].repeat(B, 0)
    scale = 1 / np.sqrt(hd)
    want = attend[0](q, *stores, k_fmt, v_fmt, positions, scale, window)
    assert_close(attend[1](q, *stores, k_fmt, v_fmt, positions, scale, window), want, atol=2e-5, rtol=1e-4)
