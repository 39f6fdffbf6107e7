"""KLD as a quality measure (``perplexity(..., reference=...)``, ``moqe perplexity --kld``): against itself a model
has KL divergence 0 and top-1 agreement 1; a quantized model's statistics equal an independent computation on the
same windows (full log-softmax of both models' logits in float64), and its reference perplexity is the reference's
own perplexity."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import tiny_model
from toolkit.model import Checkpoint, MoEModel, load_config, load_weights, perplexity
from toolkit.quant import parse_policy, quantizing_transform

IDS = list(np.random.default_rng(3).integers(3, 64, 90))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_model.write(tmp_path_factory.mktemp("kld") / "m")


def _model(ckpt, fmt=None):
    cfg = load_config(ckpt)
    policy, _ = (parse_policy("moqe", fmt) if fmt else parse_policy("none")).fit(cfg)
    return MoEModel(cfg, load_weights(Checkpoint(ckpt), cfg, quantizing_transform(policy, "numba")), "numpy")


def test_kld_of_a_model_against_itself_is_zero(ckpt):
    m = _model(ckpt)
    r = perplexity(m, IDS, 32, 16, reference=m)
    assert r["kld_mean"] == 0.0 and r["kld_p99"] == 0.0 and r["kld_max"] == 0.0
    assert r["top1_agreement"] == 1.0 and r["ref_perplexity"] == pytest.approx(r["perplexity"], rel=1e-12)


@pytest.mark.parametrize("fmt", ["int2-g32", "int4-g32"])
def test_kld_equals_an_independent_computation(ckpt, fmt):
    ref, q = _model(ckpt), _model(ckpt, fmt)
    window = stride = 45  # two disjoint windows: positions 1..44 of each are scored
    r = perplexity(q, IDS, window, stride, reference=ref)
    kl, agree = [], 0
    for begin in (0, 45):
        chunk = np.array(IDS[begin:begin + window])[None]
        lp, lq = (np.asarray(m.forward(chunk, m.new_cache(1, window)), np.float64)[0, :-1] for m in (ref, q))
        lp, lq = (x - x.max(-1, keepdims=True) for x in (lp, lq))
        lp, lq = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in (lp, lq))
        kl.append((np.exp(lp) * (lp - lq)).sum(-1))
        agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
    kl = np.concatenate(kl)
    assert r["tokens"] == kl.size == 88
    assert r["kld_mean"] == pytest.approx(kl.mean(), rel=1e-9) and r["kld_mean"] > 0
    assert r["kld_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-9)
    assert r["top1_agreement"] == agree / kl.size
    assert r["ref_perplexity"] == pytest.approx(perplexity(ref, IDS, window, stride)["perplexity"], rel=1e-9)


def test_lower_bits_diverge_more(ckpt):
    ref = _model(ckpt)
    k2, k8 = (perplexity(_model(ckpt, f), IDS, 32, 16, reference=ref)["kld_mean"] for f in ("int2-g32", "int8"))
    assert 0 < k8 < k2


def test_cli_perplexity_kld(tmp_path):
    text = tmp_path / "t.txt"
    from pathlib import Path

    text.write_text((Path(__file__).resolve().parents[1] / "data" / "heldout.txt").read_text()[:1500])
    out = subprocess.run([sys.executable, "-m", "toolkit", "perplexity", "--text", str(text), "--experts", "int2-g64",
                          "--kld", "--window", "64"], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("against full precision (perplexity "))
    assert "mean KLD" in line and "top-1 agreement" in line
    kld = float(line.split("mean KLD ")[1].split(",")[0])
    assert 0 < kld < 1, line
    # the router's fidelity beside it: int2 experts change the hidden states, so some tokens' experts flip
    assert "router fidelity against full precision" in out
    router = out.splitlines()[-1]
    overlap, flips = (float(router.split(k)[1].split(" %")[0]) for k in ("top-k overlap ", "flip rate "))
    assert 0 < overlap < 100 and 0 < flips < 100 and flips >= 100 - overlap, router
