"""Property-based fuzzing of what a checkpoint folder holds: config.json values and safetensors headers.

Every drawn input must end in one of two ways: a clear toolkit error (a ``ToolkitError`` subclass, one line
naming the file), or a model that loads and whose NumPy and Numba outputs agree. Never another exception,
never more than ``SECONDS`` per case, never more than ``PEAK_BYTES`` allocated (traced by tracemalloc,
which sees NumPy's buffers and Python's objects alike).
"""
from __future__ import annotations

import json
import math
import signal
import struct
import tracemalloc
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import tiny_model
from toolkit.errors import ToolkitError
from toolkit.model import Checkpoint, MoEModel, load_config, load_weights
from toolkit.model.inspect import check_fits

SECONDS = 20
PEAK_BYTES = 256 * 1024 * 1024
TOKENS = np.array([[3, 7, 11, 5]])

CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "max_position_embeddings",
               "rms_norm_eps", "rope_theta", "bos_token_id", "eos_token_id", "tie_word_embeddings", "head_dim",
               "sliding_window", "rope_scaling", "rope_parameters", "architectures", "torch_dtype"]

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2, 3, 4, 8, 9, 16, 63, 64, 65, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=8)
rope_values = st.fixed_dictionaries({}, optional={
    "rope_type": st.sampled_from(["default", "linear", "llama3", "yarn", "dynamic", "longrope", 3]),
    "factor": json_scalars, "low_freq_factor": json_scalars, "high_freq_factor": json_scalars,
    "original_max_position_embeddings": json_scalars, "rope_theta": json_scalars})


class CaseTimeout(Exception):
    pass


@contextmanager
def bounded(seconds: int = SECONDS):
    """Fail a case that runs longer than ``seconds`` or allocates more than PEAK_BYTES."""
    def on_alarm(*_):
        raise CaseTimeout(f"case ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
        assert peak <= PEAK_BYTES, f"case allocated {peak / 2**20:.0f} MiB at its peak (bound {PEAK_BYTES / 2**20:.0f})"
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def outcome(d) -> str:
    """'error' (a clear toolkit error) or 'ok' (loaded; NumPy and Numba agree); anything else fails."""
    try:
        cfg = load_config(d)
        check_fits(cfg, None, d)
        weights = load_weights(Checkpoint(d), cfg)
    except ToolkitError as e:
        assert "\n" not in str(e).strip() and str(d) in str(e), f"unclear message: {e}"
        return "error"
    out = {}
    for backend in ("numpy", "numba"):
        m = MoEModel(cfg, weights, backend)
        try:
            out[backend] = m.forward(TOKENS % cfg.vocab_size, m.new_cache(1, TOKENS.shape[1]))
        except ToolkitError as e:  # e.g. a context shorter than the test prompt: still a clear error
            assert "\n" not in str(e).strip(), f"unclear message: {e}"
            return "error"
    np.testing.assert_allclose(out["numba"], out["numpy"], atol=1e-4, rtol=1e-4)
    assert np.isfinite(out["numpy"]).all()
    return "ok"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tiny_model.write(tmp_path_factory.mktemp("fuzz") / "m")
    assert outcome(d) == "ok"  # the undamaged model loads (and the kernels are compiled before the bound applies)
    return d


FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=json_values, rope=rope_values)
def test_config_values(base, tmp_path_factory, key, value, rope):
    cfg = dict(tiny_model.CONFIG, **{key: value})
    if key == "rope_scaling":
        cfg[key] = rope
    d = tmp_path_factory.mktemp("case")
    (d / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity written as JSON's extensions
    (d / "model.safetensors").symlink_to(base / "model.safetensors")
    with bounded():
        event(outcome(d))


def _header(path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write(path, header, body, raw: bytes | None = None) -> None:
    blob = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + body)


header_fields = st.sampled_from(["shape", "dtype", "data_offsets", "entry"])


@FUZZ
@given(which=st.integers(0, 10**6), field=header_fields, value=json_values,
       big=st.integers(2**31, 2**70), depth=st.integers(1, 5000))
def test_safetensors_headers(base, tmp_path_factory, which, field, value, big, depth):
    header, body = _header(base / "model.safetensors")
    names = sorted(k for k in header if k != "__metadata__")
    name = names[which % len(names)]
    mode = which % 4
    raw = None
    if field == "entry":
        header[name] = value
    elif mode == 0:
        header[name][field] = value
    elif mode == 1 and field == "shape":  # element counts near and past int64
        header[name]["shape"] = [big, big]
    elif mode == 2:  # nesting depth
        raw = json.dumps({**header, "__metadata__": {"x": "y"}}).encode()[:-1] + b',"deep":' + b"[" * depth + b"]" * depth + b"}"
    else:  # an empty tensor placed over another one
        lo = header[name]["data_offsets"][0]
        header["zzz.empty"] = {"dtype": "F32", "shape": [0], "data_offsets": [lo, lo]}
        header[name]["data_offsets"] = [lo + 4, header[name]["data_offsets"][1] + 4]
    d = tmp_path_factory.mktemp("case")
    (d / "config.json").write_text(json.dumps(tiny_model.CONFIG))
    _write(d / "model.safetensors", header, body, raw)
    with bounded():
        event(outcome(d))


def test_bounds_catch_what_they_claim():
    """The harness itself can fail: a slow case and a large allocation are both caught."""
    with pytest.raises(CaseTimeout):
        with bounded(1):
            while True:
                math.sqrt(2.0)
    with pytest.raises(AssertionError, match="allocated"):
        with bounded():
            np.ones(PEAK_BYTES // 4, np.float64).sum()
