"""UQFF with mistral.rs both ways. Its bundles read by ours (toolkit/uqff/reader.py): its report schema, every
layer in the shards (attention, router, experts in q4_0 / q8_0 / q4_K; embeddings in q6_K, dequantized at load;
the LM head in q6_K as stored), mistral.rs's own greedy path. Ours (q4_0, q8_0, q4_K experts) in mistral.rs,
standalone and as an overlay: logprobs within 1e-5. mistral.rs runs in a subprocess (PyPI ``mistralrs`` 0.9.5, the
``anchors`` extra); without it the mistral.rs tests skip. The GGML decoders are held against the ``gguf`` package's
in tests/test_kquant.py."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from toolkit.load import load_model
from toolkit.uqff.spec import UQFFError

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "data" / "model"
PROMPT = "It is a truth universally acknowledged"
HAVE_MRS = importlib.util.find_spec("mistralrs") is not None
needs_mrs = pytest.mark.skipif(not HAVE_MRS, reason="mistral.rs not installed (pip install -e '.[anchors]')")

_WRITE = """
import sys
from mistralrs import Architecture, Runner, Which
Runner(Which.Plain(model_id=sys.argv[1], arch=Architecture.Mixtral, write_uqff=sys.argv[2]), in_situ_quant=sys.argv[3],
       no_paged_attn=True, prefix_cache_n=0)
"""
_LOGPROBS = """
import json, sys
from mistralrs import Architecture, ChatCompletionRequest, Runner, Which
r = Runner(Which.Plain(model_id=sys.argv[1], arch=Architecture.Mixtral, from_uqff=sys.argv[2].split(",")),
           no_paged_attn=True, prefix_cache_n=0, chat_template=sys.argv[3])
res = r.send_chat_completion_request(ChatCompletionRequest(messages=[{"role": "user", "content": sys.argv[4]}],
      model="default", max_tokens=int(sys.argv[5]), temperature=0.0, top_k=1, logprobs=True, top_logprobs=5))
print("RESULT" + json.dumps([[(t.token, t.logprob) for t in c.top_logprobs] for c in res.choices[0].logprobs.content]))
"""
STEPS = 8


def mistralrs_logprobs(model_id, shards, tmp_path) -> list:
    """mistral.rs's greedy path from PROMPT: per step, its top-5 (token id, logprob). Logprobs only come through
    a chat request, so the chat template just concatenates the messages."""
    template = tmp_path / "concat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = _mistralrs(_LOGPROBS, str(model_id), ",".join(map(str, shards)), str(template), PROMPT, str(STEPS))
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[len("RESULT"):])


def worst_logprob_gap(model, tok, theirs: list) -> float:
    """Ours along mistral.rs's greedy path: asserts the same argmax each step; returns the largest |logprob
    difference| over every step's top 5."""
    ids = tok.encode(PROMPT)
    cache = model.new_cache(1, len(ids) + len(theirs))
    logits = model.forward(np.array([ids]), cache, last_only=True)[0].astype(np.float64)
    worst = 0.0
    for step in theirs:
        lp = logits - logits.max()
        lp -= np.log(np.exp(lp).sum())
        assert int(np.argmax(lp)) == step[0][0]
        worst = max(worst, max(abs(lp[t] - v) for t, v in step))
        logits = model.forward(np.array([[step[0][0]]]), cache, last_only=True)[0].astype(np.float64)
    return worst


def _mistralrs(code: str, *args: str) -> str:
    env = dict(os.environ, MISTRALRS_CPU_KV_F32="1", RAYON_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


@pytest.fixture(scope="module")
def mistralrs_bundles(tmp_path_factory):
    """mistral.rs's own bundles of the bundled model, its default organization: quant -> folder."""
    if not HAVE_MRS:
        pytest.skip("mistral.rs not installed (pip install -e '.[anchors]')")
    out = {}
    for quant in ("Q4_0", "Q8_0", "Q4K"):
        d = tmp_path_factory.mktemp(f"mrs-{quant}")
        _mistralrs(_WRITE, str(MODEL), str(d / "model.uqff"), quant)
        out[quant] = d
    return out


@needs_mrs
@pytest.mark.parametrize("quant,fmt", [("Q4_0", "q4_0"), ("Q8_0", "q8_0"), ("Q4K", "q4_k")])
def test_a_mistralrs_bundle_loads_and_follows_mistralrs_own_greedy_path(mistralrs_bundles, quant, fmt, tmp_path):
    """Its default organization quantizes attention, routers and the head too. The greedy tokens are the same;
    logprobs differ by up to a few hundredths: mistral.rs quantizes the activations of its quantized non-expert
    linears (and q8_K ones for the q6_K head), where we multiply f32 activations by the stored weights."""
    d = mistralrs_bundles[quant]
    report = json.loads((d / "uqff_report.json").read_text())
    assert report["schema"] == 1 and "shards" not in report  # its schema, not ours
    m, tok = load_model(d)
    layer = m.layers[0]
    assert layer.ffn.expert_weights[0].fmt.name == fmt  # experts as stored
    assert layer.ffn.router.weight.fmt.name == fmt  # mistral.rs quantizes the router too
    assert layer.attn.q.weight.fmt.name == fmt
    theirs = mistralrs_logprobs(d, [d / s for o in report["outputs"] for s in o["shards"]], tmp_path)
    assert len(theirs) == STEPS
    assert worst_logprob_gap(m, tok, theirs) < 0.05


@needs_mrs
def test_a_mistralrs_bundle_with_a_missing_shard_names_it(mistralrs_bundles, tmp_path):
    d = tmp_path / "b"
    shutil.copytree(mistralrs_bundles["Q4_0"], d)
    (d / "model-0.uqff").unlink()
    with pytest.raises(UQFFError, match="model-0.uqff: missing"):
        load_model(d)


@needs_mrs
@pytest.mark.parametrize("edit,message", [(lambda r: r.update(schema=2), "schema"),
                                          (lambda r: r["outputs"][0].update(shards="x"), "shards"),
                                          (lambda r: r["outputs"][0]["layer_details"][2].update(shape=[1, 2]),
                                           "says \\[1, 2\\]")])
def test_a_bad_mistralrs_report_is_named(mistralrs_bundles, tmp_path, edit, message):
    d = tmp_path / "b"
    shutil.copytree(mistralrs_bundles["Q4_0"], d)
    r = json.loads((d / "uqff_report.json").read_text())
    edit(r)
    (d / "uqff_report.json").write_text(json.dumps(r))
    with pytest.raises(UQFFError, match=message):
        load_model(d)


# ---- the other way: bundles we write, loaded by mistral.rs ------------------------------------------------------
@pytest.fixture(scope="module")
def our_bundles(tmp_path_factory):
    from toolkit.quant import parse_policy
    from toolkit.uqff import save_bundle

    if not HAVE_MRS:
        pytest.skip("mistral.rs not installed (pip install -e '.[anchors]')")
    out = {}
    for fmt in ("q4_0", "q8_0", "q4_k", "int4"):
        d = tmp_path_factory.mktemp("ours") / fmt
        save_bundle(MODEL, d, parse_policy("moqe", fmt))
        out[fmt] = d
    return out


@needs_mrs
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k"])
@pytest.mark.parametrize("how", ["standalone", "overlay"])
def test_mistralrs_runs_our_bundle_to_our_logprobs(our_bundles, fmt, how, tmp_path):
    """Our report carries mistral.rs's fields beside ours, so mistral.rs loads the bundle on its own (model_id =
    the bundle) as well as an overlay on the checkpoint (model_id = the checkpoint): the same greedy path and
    logprobs within 1e-5 of ours (f32 activations on both sides; MoQE keeps everything but the experts dense)."""
    d = our_bundles[fmt]
    m, tok = load_model(d)
    shards = [d / s["file"] for s in json.loads((d / "uqff_report.json").read_text())["shards"]]
    theirs = mistralrs_logprobs(d if how == "standalone" else MODEL, shards, tmp_path)
    assert len(theirs) == STEPS
    assert worst_logprob_gap(m, tok, theirs) <= 1e-5


@needs_mrs
def test_mistralrs_refuses_our_own_tags_cleanly(our_bundles):
    d = our_bundles["int4"]  # int4-g128: our MoqeAffine family, tag 100
    env = dict(os.environ, MISTRALRS_CPU_KV_F32="1", RAYON_NUM_THREADS="1")
    template = d.parent / "concat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    p = subprocess.run([sys.executable, "-c", _LOGPROBS, str(d), str(d / "model-0.uqff"), str(template), PROMPT, "4"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode != 0 and "QuantizedSerdeType 100 is invalid" in p.stderr
