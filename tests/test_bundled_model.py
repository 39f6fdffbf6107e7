"""The bundled model in data/model: a golden greedy decode, parity with transformers, the CLI on it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from toolkit.model import SamplingParams, generate_tokens
from toolkit.load import load_model

MODEL = Path(__file__).resolve().parents[1] / "data" / "model"
PROMPT = "It is a truth universally acknowledged"
PROMPT_IDS = [1, 820, 343, 261, 1520, 8012, 758, 5527]  # <s> + BPE tokens of PROMPT
# greedy continuation pinned when the model was bundled (transformers gives the same text)
GOLDEN = [16, 201, 201, 4, 43, 449, 936, 306, 362, 505, 261, 484, 506, 1797, 289, 381, 662, 16, 301, 449, 936, 301, 201, 1462]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_golden_greedy_decode(backend):
    model, tok = load_model(MODEL, backend=backend)
    assert tok.encode(PROMPT) == PROMPT_IDS
    out = [e.token for e in generate_tokens(model, [PROMPT_IDS], SamplingParams(max_new_tokens=len(GOLDEN)))]
    assert out == GOLDEN
    assert tok.decode(out).startswith('.\n\n"I am sure you have been a very good deal')


def test_bundled_model_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").eval()
    model, tok = load_model(MODEL)
    ids = np.array([tok.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind")])
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits[0].numpy()
    got = model.forward(ids, model.new_cache(1, ids.shape[1]))[0]
    assert np.abs(got - ref).max() <= 1e-4


def test_cli_generate_and_perplexity_on_bundled_model(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text((MODEL.parent / "heldout.txt").read_text()[:3000])
    run = lambda *a: subprocess.run([sys.executable, "-m", "toolkit", *a], capture_output=True, text=True, check=True)  # noqa: E731
    out = run("generate", "--prompt", PROMPT, "--max-new-tokens", "12")
    assert out.stdout.startswith(PROMPT + '.\n\n"I am sure')
    out = run("perplexity", "--text", str(text), "--window", "128")
    ppl = float(out.stdout.split()[1])
    assert 5 < ppl < 500, out.stdout
    out = run("info")
    assert "MixtralForCausalLM" in out.stdout and "experts" in out.stdout


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_last_only_prunes_the_last_layers_ffn(backend, monkeypatch):
    """With last_only, the last layer's FFN runs on each sequence's last token only (as llama.cpp's prefill does):
    the logits match the full forward's at those tokens, and the cache holds every token either way."""
    from toolkit.model import model as model_mod

    model, _ = load_model(MODEL, backend=backend)
    ids = np.array([PROMPT_IDS, PROMPT_IDS[::-1]])  # [2, 8]
    lens = np.array([8, 5])  # the second sequence right-padded: its last token is row 8 + 4
    seen = []
    ffn_call = model_mod.DecoderLayer.__call__

    def spy(self, h, positions, cache, inv_freq, rope_scale, rows=None):
        out = ffn_call(self, h, positions, cache, inv_freq, rope_scale, rows)
        seen.append(out.shape[0])
        return out

    c_full, c_last = model.new_cache(2, 16), model.new_cache(2, 16)
    full = model.forward(ids, c_full, lengths=lens)  # [2, 8, V]
    monkeypatch.setattr(model_mod.DecoderLayer, "__call__", spy)
    last = model.forward(ids, c_last, lengths=lens, last_only=True)  # [2, V]
    monkeypatch.undo()
    assert seen == [16] * (len(model.layers) - 1) + [2]  # rows out of each layer: all, then the two last tokens
    want = np.stack([full[0, 7], full[1, 4]])
    assert np.abs(last - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert list(c_last.lens) == list(c_full.lens) == [8, 5]
    nxt = np.array([[PROMPT_IDS[1]], [PROMPT_IDS[2]]])  # the next step reads every cached token of both
    a = model.forward(nxt, c_full, last_only=True)
    b = model.forward(nxt, c_last, last_only=True)
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(a).max())
