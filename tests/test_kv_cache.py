"""KV cache in f32 / q8_0 / q4_0: the cache's block bytes equal gguf's, the declared quality of quantized-cache
attention, memory accounting, and the model running on each cache type. The kv_store / kv_attention ops against
their references on every backend: tests/test_ops_kv.py."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import tiny_model
from helpers import assert_close
from toolkit.errors import ModelError
from toolkit.model import Checkpoint, MoEModel, load_config, load_weights
from toolkit.model.kv_cache import KVCache, cache_bytes_per_token, parse_kv_cache

RNG = np.random.default_rng(0)
pytestmark = pytest.mark.usefixtures("kernel_build")  # serial and parallel builds
GGUF = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def _filled(pair, B, T, H, Hkv, hd, start, backend):
    S = start + T + 2
    cache = KVCache(1, B, Hkv, S, hd, pair, backend)
    k = RNG.standard_normal((B, start + T, Hkv, hd)).astype(np.float32)
    v = RNG.standard_normal((B, start + T, Hkv, hd)).astype(np.float32)
    pos = np.broadcast_to(np.arange(start + T), (B, start + T))
    cache.write(0, k, v, pos)
    return cache, k, v


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_store_bytes_equal_gguf(fmt, backend):
    cache, k, v = _filled((fmt, fmt), 2, 5, 4, 2, 64, 0, backend)
    for store, x in ((cache.k[0], k), (cache.v[0], v)):
        want = gguf.quants.quantize(x.transpose(0, 2, 1, 3), GGUF[fmt])  # [B, Hkv, T, row]
        assert_close(store[:, :, :5], want, exact=True, what=f"{fmt} {backend} cache bytes")
        assert not store[:, :, 5:].any()  # untouched rows stay empty


@pytest.mark.parametrize("kind,bound", [("q8_0", 0.02), ("q4_0", 0.25)])
def test_quantized_cache_is_close_to_f32(kind, bound):
    """Sanity of the declared quality: relative L2 error of attention output vs an f32 cache."""
    outs = []
    for pair in (("f32", "f32"), (kind, kind)):
        rng = np.random.default_rng(5)
        cache = KVCache(1, 1, 2, 64, 128, pair)
        k = rng.standard_normal((1, 64, 2, 128)).astype(np.float32)
        cache.write(0, k, rng.standard_normal((1, 64, 2, 128)).astype(np.float32), np.arange(64)[None])
        q = rng.standard_normal((1, 1, 8, 128)).astype(np.float32)
        outs.append(cache.attention(0, q, np.array([[63]]), 128**-0.5, 0))
    err = np.linalg.norm(outs[1] - outs[0]) / np.linalg.norm(outs[0])
    assert err < bound, f"{kind}: relative error {err:.4f}"


@pytest.mark.parametrize("pair,row_bytes", [(("f32", "f32"), 2 * 128 * 4), (("q8_0", "q8_0"), 2 * 4 * 34),
                                            (("q4_0", "q4_0"), 2 * 4 * 18), (("q8_0", "q4_0"), 4 * 34 + 4 * 18)])
def test_bytes_per_token(pair, row_bytes):
    cache = KVCache(3, 1, 8, 16, 128, pair)
    assert cache.bytes_per_token == 3 * 8 * row_bytes == cache_bytes_per_token(3, 8, 128, pair)


def test_q4_0_is_over_3_5x_smaller_than_f32():
    assert cache_bytes_per_token(1, 1, 128) / cache_bytes_per_token(1, 1, 128, ("q4_0", "q4_0")) > 3.5


def test_head_dim_not_multiple_of_32_is_refused():
    with pytest.raises(ModelError, match="'q4_0' needs a head dim divisible by 32; this model's head dim is 48"):
        KVCache(1, 1, 2, 8, 48, ("f32", "q4_0"))
    KVCache(1, 1, 2, 8, 48, ("f32", "f32"))  # f32 takes any head dim


@pytest.mark.parametrize("spec,want", [(None, ("f32", "f32")), ("q4_0", ("q4_0", "q4_0")), ("k=q8_0,v=q4_0", ("q8_0", "q4_0"))])
def test_parse_kv_cache(spec, want):
    assert parse_kv_cache(spec) == want


@pytest.mark.parametrize("spec", ["q5_0", "k=q8_0,x=f32"])
def test_bad_cache_spec(spec):
    with pytest.raises(ModelError):
        parse_kv_cache(spec)


# A sanity bound for q8_0 on a random tiny model (hd 32: one block per row). q4_0's effect on a random
# model says little; its quality is measured on the trained model by `python -m toolkit.bench kv`.
@pytest.mark.parametrize("pair,tol", [(("q8_0", "q8_0"), 0.08), (("q4_0", "q4_0"), None), (("q8_0", "q4_0"), None)])
def test_model_on_quantized_cache(tmp_path, pair, tol):
    """Prefill + decode on a quantized cache: close to f32, numpy == numba, storage never reallocated."""
    d = tiny_model.write(tmp_path / "m", cfg={**tiny_model.CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1})
    cfg = load_config(d)  # head dim 32
    w = load_weights(Checkpoint(d), cfg)
    ids = np.random.default_rng(1).integers(3, 64, (1, 12))
    outs = {}
    for name, kv, backend in (("f32", None, "numba"), ("q-numba", pair, "numba"), ("q-numpy", pair, "numpy")):
        m = MoEModel(cfg, w, backend, kv_cache=kv)
        cache = m.new_cache(1, 16)
        before = [id(a) for a in cache.k + cache.v]
        first = m.forward(ids[:, :8], cache)
        steps = [m.forward(ids[:, t : t + 1], cache)[:, 0] for t in range(8, 12)]
        assert [id(a) for a in cache.k + cache.v] == before
        outs[name] = np.concatenate([first[0], np.concatenate(steps)])
    assert_close(outs["q-numba"], outs["q-numpy"], atol=1e-4, rtol=1e-4)
    rel = np.abs(outs["q-numba"] - outs["f32"]).max() / np.abs(outs["f32"]).max()
    assert rel > 0  # the cache really is quantized
    assert tol is None or rel < tol, f"{pair}: max relative logit change {rel:.4f}"
