"""Routing traces (``toolkit/quant/trace.py``): counts and pairs equal what the router chose, token by token
(against the experts' own recorded inputs and a brute-force count); router fidelity by its definition on hand-made
traces; the file round trip exact and every malformed file refused with the reason."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tiny_model
from test_plan import _never_route_expert_3  # layer 0's expert 3 never routed

from toolkit.errors import FormatError, ModelError
from toolkit.model import Checkpoint, MoEModel, load_config, load_weights
from toolkit.model.safetensors_io import SafeTensorsFile, save_file
from toolkit.quant import trace as tr
from toolkit.quant.sensitivity import record_layers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tiny_model.write(tmp_path_factory.mktemp("trace") / "m", mutate=_never_route_expert_3)
    c = load_config(d)
    return MoEModel(c, load_weights(Checkpoint(d), c), "numpy")


IDS = np.random.default_rng(3).integers(3, 64, 80)  # 80 tokens: windows of 32, 32 and 16


def brute(ids: np.ndarray, E: int):
    """counts [E], pairs [E, E] of ids [T, A], one token at a time."""
    counts, pairs = np.zeros(E, np.int64), np.zeros((E, E), np.int64)
    for row in ids:
        for e in set(row.tolist()):
            counts[e] += 1
            for f in set(row.tolist()):
                pairs[e, f] += 1
    return counts, pairs


def test_record_counts_what_the_router_chose(model):
    before = [layer.ffn.experts for layer in model.layers]
    t = tr.record(model, IDS, window=32, keep_ids=True, source="unit")
    seen = record_layers(model, IDS, 32)  # the experts' own inputs, the same windows
    assert t.layers == (0, 1) and t.tokens == 80 and t.top_k == 2 and t.experts == 4
    for j, i in enumerate(t.layers):
        routed = np.concatenate([r[1] for r in seen[i]])  # [T, A] in token order
        np.testing.assert_array_equal(t.ids[j], routed.astype(np.int32))
        counts, pairs = brute(routed, 4)
        np.testing.assert_array_equal(t.counts[j], counts)
        np.testing.assert_array_equal(t.pairs[j], pairs)
        assert t.counts[j].sum() == 80 * 2
    assert t.counts[0, 3] == 0 and (t.pairs[0, 3] == 0).all()  # the expert the router never picks
    np.testing.assert_allclose(t.shares().sum(axis=1), 1.0)
    assert t.imbalance()[0] >= 4 / 3  # 3 experts share layer 0's slots
    assert [layer.ffn.experts for layer in model.layers] == before  # hooks removed


def test_record_without_ids_keeps_only_counts(model):
    t = tr.record(model, IDS[:20], window=32)
    assert t.ids is None and t.counts.sum() == 2 * 20 * 2


def test_record_removes_its_hooks_when_the_model_fails(model, monkeypatch):
    before = [layer.ffn.experts for layer in model.layers]
    monkeypatch.setattr(model, "new_cache", lambda *a: (_ for _ in ()).throw(RuntimeError("no memory")))
    with pytest.raises(RuntimeError, match="no memory"):
        tr.record(model, IDS, window=32)
    assert [layer.ffn.experts for layer in model.layers] == before


def test_record_refuses_no_tokens(model):
    with pytest.raises(ModelError, match="no tokens"):
        tr.record(model, [], window=32)


def _trace(ids: np.ndarray, E: int = 4) -> tr.Trace:
    counts, pairs = brute(ids, E)
    return tr.Trace((0,), counts[None], pairs[None], ids.shape[0], ids.shape[1], ids[None].astype(np.int32))


# (reference ids, other ids, top-k overlap, flip rate): the same sets in another order agree; one expert of two
# changed is half a token's overlap and a flip
FIDELITY = [([[0, 1], [2, 3]], [[1, 0], [3, 2]], 1.0, 0.0),
            ([[0, 1], [2, 3]], [[1, 0], [2, 0]], 0.75, 0.5),
            ([[0, 1], [2, 3]], [[2, 3], [0, 1]], 0.0, 1.0)]


@pytest.mark.parametrize("ref, got, overlap, flips", FIDELITY)
def test_fidelity_by_definition(ref, got, overlap, flips):
    rows = tr.fidelity(_trace(np.array(ref)), _trace(np.array(got)))
    assert rows == [{"layer": 0, "top-k overlap": overlap, "flip rate": flips}]


def test_fidelity_needs_ids_and_the_same_tokens():
    a = _trace(np.array([[0, 1], [2, 3]]))
    with pytest.raises(ModelError, match="keep_ids"):
        tr.fidelity(a, tr.Trace(a.layers, a.counts, a.pairs, 2, 2))
    with pytest.raises(ModelError, match="differ"):
        tr.fidelity(a, _trace(np.array([[0, 1]])))


@pytest.mark.parametrize("keep_ids", [False, True])
def test_file_round_trip(model, tmp_path, keep_ids):
    t = tr.record(model, IDS, window=32, keep_ids=keep_ids, source="text.txt")
    tr.save(tmp_path / "t.safetensors", t)
    back = tr.load(tmp_path / "t.safetensors")
    assert (back.layers, back.tokens, back.top_k, back.source) == (t.layers, t.tokens, t.top_k, "text.txt")
    np.testing.assert_array_equal(back.counts, t.counts)
    np.testing.assert_array_equal(back.pairs, t.pairs)
    assert (back.ids is None) == (not keep_ids)
    if keep_ids:
        np.testing.assert_array_equal(back.ids, t.ids)


def _bad(t: dict, meta: dict, key: str, value):
    if key.startswith("meta:"):
        meta[key[5:]] = value
    elif value is None:
        del t[key]
    else:
        t[key] = value


# (what is changed, the new value (None: removed), the message's words)
BAD = [("meta:kind", "imatrix", "not a routing trace"),
       ("meta:tokens", "many", "integer"),
       ("meta:top_k", "9", "top_k <= experts"),
       ("layers.0.pairs", None, "needs both counts and pairs"),
       ("layers.0.counts", np.zeros(4, np.int64), "sum to tokens x top_k"),
       ("layers.0.counts", np.zeros(5, np.int64), "want int64 [4]"),
       ("layers.1.pairs", np.eye(4, dtype=np.int64) * 40, "symmetric with counts"),
       ("layers.0.ids", np.full((80, 2), 4, np.int32), "in 0..3"),
       ("layers.0.ids", np.zeros((80, 2), np.int64), "want int32"),
       ("layers.1.ids", None, "some layers hold ids"),
       ("layers.0.gate", np.zeros(4, np.float32), "unexpected tensor")]


@pytest.mark.parametrize("key, value, words", BAD, ids=[f"{k}-{w}" for k, _, w in BAD])
def test_load_refuses_a_malformed_trace(model, tmp_path, key, value, words):
    tr.save(tmp_path / "good.safetensors", tr.record(model, IDS, window=32, keep_ids=True))
    f = SafeTensorsFile(tmp_path / "good.safetensors")
    t, meta = {k: np.array(f.get(k)) for k in f.keys()}, dict(f.metadata)
    _bad(t, meta, key, value)
    save_file(t, tmp_path / "bad.safetensors", metadata=meta)
    with pytest.raises(FormatError, match=re.escape(words)):
        tr.load(tmp_path / "bad.safetensors")


def test_moqe_trace_writes_a_trace_of_the_text(tmp_path, capsys):
    """The command on a tiny checkpoint: the file holds every token's routing, its table names each layer."""
    from toolkit.cli import main

    import shutil
    from pathlib import Path

    m = tiny_model.write(tmp_path / "m", {**tiny_model.CONFIG, "vocab_size": 8192})  # the bundled tokenizer's
    data = Path(__file__).resolve().parents[1] / "data" / "model"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data / f, m / f)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    out = tmp_path / "trace.safetensors"
    rc = main(["trace", "--model", str(m), "--text", str(text), "--out", str(out), "--window", "16", "--ids",
               "--backend", "numpy"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    t = tr.load(out)
    assert t.layers == (0, 1) and t.ids.shape == (2, t.tokens, 2) and t.tokens > 16
    assert (t.counts.sum(axis=1) == 2 * t.tokens).all() and t.source == str(text)
    assert "routing of" in printed and f"wrote {out}" in printed
    assert main(["trace", "--model", str(m), "--text", str(text), "--out", str(out), "--window", "1"]) == 2


def test_recorders_on_two_models_give_fidelity(model):
    """Two recorders on the same model over the same windows (as ``moqe perplexity --kld`` installs them on the
    reference and the quantized model): identical routing, overlap 1 and no flips; on exit the hooks are gone."""
    before = [layer.ffn.experts for layer in model.layers]
    with tr.Recorder(model, keep_ids=True) as a:
        for chunk in (IDS[:32], IDS[32:64]):
            model.forward(chunk[None], model.new_cache(1, len(chunk)))
    with tr.Recorder(model, keep_ids=True) as b:
        for chunk in (IDS[:32], IDS[32:64]):
            model.forward(chunk[None], model.new_cache(1, len(chunk)))
    assert [layer.ffn.experts for layer in model.layers] == before
    assert a.trace().tokens == 64
    assert tr.fidelity(a.trace(), b.trace()) == [{"layer": i, "top-k overlap": 1.0, "flip rate": 0.0} for i in (0, 1)]
