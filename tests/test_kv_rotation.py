"""The rotated key cache (``--kv-rotate``): keys are stored, and queries read, rotated by the orthonormal Hadamard
matrix of the head dim. Exact arithmetic leaves q . k unchanged, so with an f32 cache the logits match the
unrotated model to f32 rounding, on every backend; with a quantized cache the stored bytes differ (the point: the
blocks quantize rotated keys), and the CUDA backend (emulated) matches NumPy. The numba backend's compiled decode
step rotates inside its kernel with the staged stages' bits. ``auto`` (the default) rotates the K types of
``KV_ROTATE_AUTO`` (q4_0, measured in docs/kv-cache.md). Where it cannot apply (a head dim that is not a power of two,
MLA's latent rows) it is refused with the reason."""
from __future__ import annotations

import numpy as np
import pytest

import tiny_model
from helpers import assert_close
from toolkit.errors import ModelError
from toolkit.model import Checkpoint, MoEModel, load_config, load_weights
from toolkit.model.kv_cache import KVCache, hadamard

TOKENS = np.array([[3, 5, 7, 9, 11, 13, 2, 4], [4, 6, 8, 10, 12, 14, 16, 18]])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):  # head dim 32 (the GGML caches need a multiple of 32)
    cfg = dict(tiny_model.CONFIG, num_attention_heads=2, num_key_value_heads=1)
    return tiny_model.write(tmp_path_factory.mktemp("rot") / "m", cfg=cfg)


def _model(ckpt, backend, kv, rotate):
    cfg = load_config(ckpt)
    m = MoEModel(cfg, load_weights(Checkpoint(ckpt), cfg), backend, kv_cache=kv)
    m.kv_rotate = rotate
    return m


def _logits(m):
    c = m.new_cache(2, 12)
    out = [m.rt.host(m.forward(TOKENS, c, last_only=True))]
    for step in range(2):
        out.append(m.rt.host(m.decode(np.array([5 + step, 7 + step]), c)))
    return np.stack(out), c


@pytest.mark.parametrize("n", [2, 32, 128])
def test_hadamard_is_orthonormal_and_symmetric(n):
    h = hadamard(n).astype(np.float64)
    assert_close(h @ h, np.eye(n), atol=1e-6)
    assert np.array_equal(h, h.T) and set(np.unique(np.abs(h) * np.sqrt(n)).round(6)) == {1.0}


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_rotation_leaves_f32_attention_unchanged(ckpt, backend):
    plain, _ = _logits(_model(ckpt, backend, "f32", "off"))
    rot, cache = _logits(_model(ckpt, backend, "f32", "on"))
    assert cache.rotation is not None
    assert_close(rot, plain, atol=2e-5, rtol=2e-5)


def test_rotated_quantized_keys_are_other_bytes_and_the_emulated_device_agrees(ckpt):
    _, off = _logits(_model(ckpt, "numpy", "q4_0", "off"))
    ref, on = _logits(_model(ckpt, "numpy", "q4_0", "on"))
    assert not np.array_equal(np.asarray(off.k[0]), np.asarray(on.k[0]))  # keys quantized after the rotation
    assert np.array_equal(np.asarray(off.v[0]), np.asarray(on.v[0]))  # values untouched
    emu, _ = _logits(_model(ckpt, "cuda-emu", "q4_0", "on"))
    assert_close(emu, ref, atol=5e-2, rtol=5e-2)  # q4_0 written on each step: a last-ulp input can flip a code


# ---- the compiled decode step (toolkit/model/decode_step.py) on a rotated cache --------------------------------
# (K / V cache, logits tolerance against the staged stages). Both paths rotate one token with kv_rotate (the same
# gemv_f32 per row), so the stored keys and the logits are the same bits; against the NumPy reference a
# quantized cache is held to the emulated device's bound above.
COMPILED_ROTATED = [("q4_0", 0.0), ("q8_0", 0.0), ("k=q4_0,v=f32", 0.0)]
DECODE = [5, 7, 9, 11, 13, 15]  # one-token steps after the first row of TOKENS


def _spy_compiled(m):
    """Wrap each layer's compiled step; the list returned records what each call returned (True: it ran)."""
    ran = []

    def spy(s):
        def step(*args):
            ran.append(s(*args))
            return ran[-1]
        step.work = s.work
        return step

    m._steps = [spy(s) if s is not None else None for s in m._compiled_steps()]
    return ran


def _decode_logits(m):  # prefill TOKENS[:1], then DECODE one token at a time -> [1 + len(DECODE), V]; the cache
    c = m.new_cache(1, TOKENS.shape[1] + len(DECODE))
    out = [m.rt.host(m.forward(TOKENS[:1], c, last_only=True))[0]]
    out += [m.rt.host(m.decode(np.array([t]), c))[0] for t in DECODE]
    return np.stack(out), c


@pytest.mark.parametrize("kv,atol", COMPILED_ROTATED)
def test_compiled_decode_step_rotates_like_the_staged_stages(ckpt, kv, atol):
    got, caches = {}, {}
    for mode in ("off", "on"):  # staged stages; the compiled step (compiled here if needed)
        m = _model(ckpt, "numba", kv, "on")
        m.compiled_decode = mode
        ran = _spy_compiled(m) if mode == "on" else []
        got[mode], caches[mode] = _decode_logits(m)
        assert caches[mode].rotation is not None
    n_layers = tiny_model.CONFIG["num_hidden_layers"]
    assert ran == [True] * (n_layers * len(DECODE)), f"compiled step calls {ran}"  # every layer, every step
    assert_close(got["on"], got["off"], atol=atol, exact=atol == 0.0, what=f"compiled vs staged, {kv} rotated")
    for layer in range(n_layers):  # the keys were stored rotated by both paths: the same bytes
        assert np.array_equal(caches["on"].k[layer], caches["off"].k[layer]), f"layer {layer} keys"
    ref, _ = _decode_logits(_model(ckpt, "numpy", kv, "on"))
    assert_close(got["on"], ref, atol=5e-2, rtol=5e-2, what=f"compiled vs NumPy reference, {kv} rotated")


@pytest.mark.parametrize("kv,rotated", [("q4_0", True), ("k=q4_0,v=q8_0", True), ("q8_0", False), ("f32", False)])
def test_auto_rotates_q4_0_keys(ckpt, kv, rotated):
    assert (_model(ckpt, "numpy", kv, "auto").new_cache(1, 4).rotation is not None) == rotated


def test_rotation_refused_where_it_cannot_apply():
    with pytest.raises(ModelError, match="power-of-two head dim"):
        KVCache(1, 1, 1, 4, 48, ("q8_0", "q8_0"), "numpy", rotate_k=True)
    with pytest.raises(ModelError, match="MLA latent rows"):
        KVCache(1, 1, 1, 4, 64, ("q8_0", "q8_0"), "numpy", shared_v=True, rotate_k=True)
