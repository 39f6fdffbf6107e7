"""UQFF bundles that mistral.rs writes, read by ours (toolkit/uqff/reader.py): its report schema, every layer in
the shards (attention, router, experts in q4_0 / q8_0; embeddings and LM head in q6_K, dequantized at load),
the greedy text mistral.rs itself generates from the same bundle. mistral.rs runs in a subprocess (PyPI
``mistralrs`` 0.9.5, the ``anchors`` extra); without it the mistral.rs tests skip. The q6_K decoder is held
against the ``gguf`` package's."""
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
from toolkit.model import SamplingParams, generate_tokens
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
_GENERATE = """
import json, sys
from mistralrs import Architecture, CompletionRequest, Runner, Which
r = Runner(Which.Plain(model_id=sys.argv[1], arch=Architecture.Mixtral, from_uqff=sys.argv[2].split(",")),
           no_paged_attn=True, prefix_cache_n=0)
res = r.send_completion_request(CompletionRequest(prompt=sys.argv[3], model="default", max_tokens=int(sys.argv[4]),
                                                  temperature=0.0, top_k=1, ignore_eos=True))
print("RESULT" + json.dumps(res.choices[0].text))
"""


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
    for quant in ("Q4_0", "Q8_0"):
        d = tmp_path_factory.mktemp(f"mrs-{quant}")
        _mistralrs(_WRITE, str(MODEL), str(d / "model.uqff"), quant)
        out[quant] = d
    return out


@needs_mrs
@pytest.mark.parametrize("quant,fmt", [("Q4_0", "q4_0"), ("Q8_0", "q8_0")])
def test_a_mistralrs_bundle_loads_and_generates_mistralrs_own_text(mistralrs_bundles, quant, fmt):
    d = mistralrs_bundles[quant]
    report = json.loads((d / "uqff_report.json").read_text())
    assert report["schema"] == 1 and "shards" not in report  # its schema, not ours
    m, tok = load_model(d)
    layer = m.layers[0]
    assert layer.ffn.expert_weights[0].fmt.name == fmt  # experts as stored
    assert layer.ffn.router.weight.fmt.name == fmt  # mistral.rs quantizes the router too
    assert layer.attn.q.weight.fmt.name == fmt
    ids = tok.encode(PROMPT)
    ours = tok.decode([e.token for e in generate_tokens(m, [ids], SamplingParams(max_new_tokens=16))])
    shards = ",".join(str(d / s) for o in report["outputs"] for s in o["shards"])
    out = _mistralrs(_GENERATE, str(d), shards, PROMPT, "16")
    theirs = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[len("RESULT"):])
    assert ours == theirs


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


def test_q6_k_decoder_equals_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    from toolkit.formats.ggml import q6_k_dequantize

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (9, 210), dtype=np.uint8)
    raw[:, 208:] = np.frombuffer((rng.standard_normal(9) * 0.01).astype(np.float16).tobytes(), np.uint8).reshape(9, 2)
    want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.Q6_K).reshape(-1)
    assert np.array_equal(q6_k_dequantize(raw, 9 * 256), want)


# ---- the other way: bundles we write, loaded by mistral.rs ------------------------------------------------------
@pytest.fixture(scope="module")
def our_bundles(tmp_path_factory):
    from toolkit.quant import parse_policy
    from toolkit.uqff import save_bundle

    if not HAVE_MRS:
        pytest.skip("mistral.rs not installed (pip install -e '.[anchors]')")
    out = {}
    for fmt in ("q4_0", "q8_0", "int4"):
        d = tmp_path_factory.mktemp("ours") / fmt
        save_bundle(MODEL, d, parse_policy("moqe", fmt))
        out[fmt] = d
    return out


@needs_mrs
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("how", ["standalone", "overlay"])
def test_mistralrs_runs_our_bundle_to_our_greedy_text(our_bundles, fmt, how):
    """Our report carries mistral.rs's fields beside ours, so mistral.rs loads the bundle on its own (model_id =
    the bundle) as well as an overlay on the checkpoint (model_id = the checkpoint)."""
    d = our_bundles[fmt]
    m, tok = load_model(d)
    ours = tok.decode([e.token for e in generate_tokens(m, [tok.encode(PROMPT)], SamplingParams(max_new_tokens=16))])
    model_id = d if how == "standalone" else MODEL
    shards = ",".join(str(d / s["file"]) for s in json.loads((d / "uqff_report.json").read_text())["shards"])
    out = _mistralrs(_GENERATE, str(model_id), shards, PROMPT, "16")
    assert json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[len("RESULT"):]) == ours


@needs_mrs
def test_mistralrs_refuses_our_own_tags_cleanly(our_bundles):
    d = our_bundles["int4"]  # int4-g128: our MoqeAffine family, tag 100
    env = dict(os.environ, MISTRALRS_CPU_KV_F32="1", RAYON_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _GENERATE, str(d), str(d / "model-0.uqff"), PROMPT, "4"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode != 0 and "QuantizedSerdeType 100 is invalid" in p.stderr
