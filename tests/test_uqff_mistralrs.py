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


def mistralrs_logprobs(model_id, shards, tmp_path, arch: str = "Mixtral") -> list:
    """mistral.rs's greedy path from PROMPT: per step, its top-5 (token id, logprob). Logprobs only come through
    a chat request, so the chat template just concatenates the messages."""
    template = tmp_path / "concat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = _mistralrs(_LOGPROBS.replace("Architecture.Mixtral", f"Architecture.{arch}"), str(model_id),
                     ",".join(map(str, shards)), str(template), PROMPT, str(STEPS))
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[len("RESULT"):])


def worst_logprob_gap(model, tok, theirs: list, tie: float = 0.0) -> float:
    """Ours along mistral.rs's greedy path: asserts the same argmax each step (where its top two are more than
    ``tie`` apart); returns the largest |logprob difference| over every step's top 5."""
    ids = tok.encode(PROMPT)
    cache = model.new_cache(1, len(ids) + len(theirs))
    logits = model.forward(np.array([ids]), cache, last_only=True)[0].astype(np.float64)
    worst = 0.0
    for step in theirs:
        lp = logits - logits.max()
        lp -= np.log(np.exp(lp).sum())
        assert int(np.argmax(lp)) == step[0][0] or step[0][1] - step[1][1] <= tie
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


# ---- a second architecture: Qwen3-MoE (the wheel has no Qwen2-MoE) ----------------------------------------------
@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A small random Qwen3-MoE checkpoint with the hub's config keys (transformers 5 writes ``num_local_experts``
    and ``rope_parameters``; Qwen/Qwen3-30B-A3B's config.json, which mistral.rs 0.9.5 parses, has ``num_experts``,
    ``rope_theta`` and ``max_window_layers``)."""
    if not HAVE_MRS:
        pytest.skip("mistral.rs not installed (pip install -e '.[anchors]')")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("qwen3moe")
    cfg = transformers.Qwen3MoeConfig(vocab_size=8192, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                                      head_dim=32, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, num_hidden_layers=2, norm_topk_prob=True,
                                      max_position_embeddings=128, initializer_range=0.15, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    c.update(num_experts=c.get("num_local_experts", 4), rope_theta=c.get("rope_parameters", {}).get("rope_theta", 1e6),
             max_window_layers=c["num_hidden_layers"])
    (d / "config.json").write_text(json.dumps(c))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((MODEL / f).read_bytes())
    return d


@needs_mrs
@pytest.mark.parametrize("fmt,how", [("q4_0", "standalone"), ("q8_0", "overlay")])
def test_mistralrs_runs_our_qwen3_moe_bundle_to_our_logprobs(qwen3_moe, fmt, how, tmp_path):
    from toolkit.quant import parse_policy
    from toolkit.uqff import save_bundle

    d = tmp_path / "b"
    save_bundle(qwen3_moe, d, parse_policy("moqe", fmt))
    m, tok = load_model(d)
    assert m.layers[0].ffn.expert_weights[0].fmt.name == fmt
    shards = [d / s["file"] for s in json.loads((d / "uqff_report.json").read_text())["shards"]]
    theirs = mistralrs_logprobs(d if how == "standalone" else qwen3_moe, shards, tmp_path, "Qwen3Moe")
    assert len(theirs) == STEPS
    assert worst_logprob_gap(m, tok, theirs) <= 1e-5


@needs_mrs
def test_a_mistralrs_qwen3_moe_bundle_loads_and_follows_its_path(qwen3_moe, tmp_path):
    """mistral.rs's Q8_0 bundle (attention, router, experts in q8_0 with its q8 activations): along its greedy path
    our logprobs are within a few hundredths; this random model's top two can be that close, so the argmax is
    held only where mistral.rs's margin exceeds 0.1."""
    d = tmp_path / "mrs"
    d.mkdir()
    _mistralrs(_WRITE.replace("Architecture.Mixtral", "Architecture.Qwen3Moe"), str(qwen3_moe), str(d / "model.uqff"),
               "Q8_0")
    report = json.loads((d / "uqff_report.json").read_text())
    m, tok = load_model(d)
    assert m.layers[0].ffn.expert_weights[0].fmt.name == "q8_0" and m.layers[0].attn.q.weight.fmt.name == "q8_0"
    theirs = mistralrs_logprobs(d, [d / s for o in report["outputs"] for s in o["shards"]], tmp_path, "Qwen3Moe")
    assert len(theirs) == STEPS
    assert worst_logprob_gap(m, tok, theirs, tie=0.1) < 0.05
