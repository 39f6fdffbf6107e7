"""Fuzz: mutate the header (metadata and tensor table) and data bytes of a small GGUF file, or cut it short;
every load either succeeds with finite logits or raises the toolkit's error type, naming the file (never
another exception, a crash or a hang). Two files: q4_0 experts (a tiny checkpoint) and q4_K experts (the tiny
checkpoint 256 wide: k-quant super-blocks need K a multiple of 256). Bounded by GGUF_FUZZ_CASES (the k-quant file
gets a quarter)."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("gguf")

import tiny_model  # noqa: E402
from test_uqff_support import _with_tokenizer  # noqa: E402
from toolkit.errors import ToolkitError  # noqa: E402
from toolkit.gguf.export import export_gguf  # noqa: E402
from toolkit.load import load_model  # noqa: E402
from toolkit.quant import parse_policy  # noqa: E402

FUZZ_CASES = int(os.environ.get("GGUF_FUZZ_CASES", "80"))
_STATE: dict = {}
OUTCOMES: Counter = Counter()


def _base(fmt: str) -> dict:
    if fmt not in _STATE:
        import gguf

        root = Path(tempfile.mkdtemp(prefix="gguf_fuzz_"))
        cfg = tiny_model.CONFIG if fmt == "q4_0" else dict(tiny_model.CONFIG, num_hidden_layers=1, hidden_size=256,
                                                           intermediate_size=256)
        ckpt = _with_tokenizer(tiny_model.write(root / "ckpt", cfg))
        export_gguf(ckpt, root / "m.gguf", parse_policy("moqe", fmt))
        r = gguf.GGUFReader(root / "m.gguf")
        _STATE[fmt] = dict(root=root, raw=(root / "m.gguf").read_bytes(),
                           data_start=int(min(t.data_offset for t in r.tensors)))
    return _STATE[fmt]


@pytest.fixture(scope="module", autouse=True)
def _remove_bases():
    """The base files are made once per format for the module; removed after it (they were left in the temp dir)."""
    yield
    for state in _STATE.values():
        shutil.rmtree(state["root"], ignore_errors=True)
    _STATE.clear()


mutation = st.fixed_dictionaries({
    "region": st.sampled_from(["header", "header", "data"]),
    "edits": st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4),
    "truncate": st.sampled_from([None, None, None, 0.3, 0.9, 0.999]),
})


@settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(m=mutation)
def test_fuzz_mutated_gguf(m):
    _case("q4_0", m)


@settings(max_examples=max(1, FUZZ_CASES // 4), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(m=mutation)
def test_fuzz_mutated_k_quant_gguf(m):
    _case("q4_k", m)


def _case(fmt: str, m: dict) -> None:
    base = _base(fmt)
    root, raw, start = base["root"], bytearray(base["raw"]), base["data_start"]
    lo, hi = (4, start) if m["region"] == "header" else (start, len(raw))
    for pos, value in m["edits"]:
        i = lo + int(pos * (hi - lo))
        raw[i] ^= value
    if m["truncate"] is not None:
        raw = raw[: int(len(raw) * m["truncate"])]
    f = Path(tempfile.mkstemp(prefix="case_", suffix=".gguf", dir=root)[1])
    f.write_bytes(bytes(raw))
    try:
        model, tok = load_model(f)
        ids = np.array([[1, 5, 9, 13]]) % model.cfg.vocab_size
        out = model.forward(ids, model.new_cache(1, 4))
        assert np.isfinite(out).all() or m["region"] == "data"  # a changed weight byte is a changed weight
        OUTCOMES[f"{fmt} loaded"] += 1
    except ToolkitError as e:
        assert str(f) in str(e) or f.name in str(e), f"error does not name the file: {e}"
        OUTCOMES[f"{fmt} refused"] += 1
    finally:
        f.unlink()


def test_fuzz_outcomes_were_counted():
    print(f"GGUF fuzz outcomes: {dict(OUTCOMES)}")
    assert sum(OUTCOMES.values()) > 0
