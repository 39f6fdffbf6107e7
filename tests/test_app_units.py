"""The app's pieces without a server: configuration parsing, output-root confinement, the LRU model cache."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from app.configs import InputError, context_limit, parse_config, parse_configs, parse_count  # noqa: E402
from app.models import ModelCache, view  # noqa: E402
from app.paths import bundle_under_root, under_root  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "data" / "model"

BAD_CONFIGS = [  # (format, policy, kv) -> words in the message
    (("int9", "moqe", "f32"), "expert format"),
    (("int4", "most", "f32"), "policy"),
    (("int4", "moqe", "q2_k"), "KV cache"),
]


@pytest.mark.parametrize("row,words", BAD_CONFIGS)
def test_bad_config_is_named(row, words):
    with pytest.raises(InputError, match=words):
        parse_config(*row)


@pytest.mark.parametrize("n", [1, 5, "x", None])
def test_config_count_bounds(n):
    with pytest.raises(InputError, match="2, 3 or 4"):
        parse_configs(n, [("none", "moqe", "f32")] * 4)


@pytest.mark.parametrize("value", [0, 201, 2.5, "many", None])
def test_count_bounds(value):
    with pytest.raises(InputError, match="max new tokens"):
        parse_count(value, "max new tokens", 1, 200)


def test_context_is_the_training_context():
    assert context_limit(MODEL) == 256


@pytest.mark.parametrize("name", ["../escape", "/etc", "a/../../b", "", "."])
def test_paths_outside_the_root_are_refused(tmp_path, name):
    with pytest.raises(InputError):
        under_root(tmp_path / "root", name)


def test_symlink_escape_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    assert under_root(root, "ok/b1") == (root / "ok" / "b1").resolve()
    with pytest.raises(InputError, match="outside"):
        under_root(root, "link/b1")
    with pytest.raises(InputError, match="no UQFF bundle"):
        bundle_under_root(root, "missing")


def test_cache_is_lru_bounded_and_shares_weights_across_kv_types():
    cache = ModelCache(capacity=2)
    a, hit = cache.get(MODEL, parse_config("none", "moqe", "f32"))
    assert not hit
    b, hit = cache.get(MODEL, parse_config("none", "moqe", "q4_0"))  # same weights, other KV type
    assert hit and b is a
    assert view(a, "q4_0").kv_types == ("q4_0", "q4_0") and a.model.kv_types == ("f32", "f32")
    cache.get(MODEL, parse_config("int8", "moqe", "f32"))
    cache.get(MODEL, parse_config("none", "moqe", "f32"))  # touch: int8 is now the oldest
    cache.get(MODEL, parse_config("int4", "moqe", "f32"))  # evicts int8
    labels = [k[1] for k in cache.keys()]
    assert labels == ["none", "moqe:int4-g64"] or labels == ["none", "moqe:int4"], labels
    assert cache.get(MODEL, parse_config("int4", "moqe", "f32"))[1]
    assert not cache.get(MODEL, parse_config("int8", "moqe", "f32"))[1]


def test_a_request_during_warm_up_says_so_then_runs(tmp_path):
    """Before the kernels are ready, Compare streams 'Preparing kernels (first run only)' instead of hanging."""
    import threading

    from app import handlers as h
    from app.kernels import WAITING, KernelWarmup
    from app.ui import AppSettings

    settings = AppSettings(output_root=tmp_path)
    cache = ModelCache(2)
    cache.kernels = KernelWarmup(echo=None)  # never started: not ready until set below
    slots = ["none", "moqe", "f32", "int4", "moqe", "f32"] + ["none", "moqe", "f32"] * 2
    gen = h.compare(settings, cache, str(MODEL), 2, *slots, "It is", 2, 0.0, 1)
    first = next(gen)
    assert first[0].startswith(WAITING) and first[1].startswith(WAITING)
    threading.Timer(0.3, cache.kernels.ready.set).start()
    outs = list(gen)
    assert outs[-1][0] and not outs[-1][0].startswith(WAITING)  # then the generation itself
