"""An ``eos_token_id`` the vocabulary cannot produce (OLMoE's family default, 50279, kept in a checkpoint
with a smaller vocabulary: transformers runs it) is a warning, not a refusal: the id is left out of the stop
ids, the model loads and generates. Negative and non-integer ids are still refused."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

import tiny_model
from toolkit.errors import ModelError
from toolkit.model import load_config

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "data" / "model"
VOCAB = 8192  # the bundled tokenizer's: "hi" encodes to ids the tiny model has
OUTSIDE = VOCAB + 100
SHAPE = {**tiny_model.CONFIG, "vocab_size": VOCAB, "num_hidden_layers": 1}
OLMOE = dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
             max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
             norm_topk_prob=False, clip_qkv=None, pad_token_id=1, bos_token_id=None, eos_token_id=50279,
             tie_word_embeddings=False, dtype="float32")


def _as_olmoe(t: dict) -> None:
    """tiny_model's Mixtral tensors under OLMoE's names, with its q/k norms over the whole projections."""
    import numpy as np

    for name in list(t):
        new = (name.replace("block_sparse_moe.", "mlp.").replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.")
               .replace(".w2.", ".down_proj."))
        t[new] = t.pop(name)
        if new.endswith("self_attn.q_proj.weight") or new.endswith("self_attn.k_proj.weight"):
            t[new.replace("_proj.weight", "_norm.weight")] = np.ones(t[new].shape[0], np.float32)


def olmoe_checkpoint(d: Path, eos, gen_eos="same") -> Path:
    """A tiny OLMoE checkpoint laid out as transformers saves one (config.json, generation_config.json,
    model.safetensors), with the bundled model's tokenizer."""
    tiny_model.write(d, SHAPE, mutate=_as_olmoe)
    (d / "config.json").write_text(json.dumps({**OLMOE, "eos_token_id": eos}))
    gen = {"_from_model_config": True, "pad_token_id": 1}
    if gen_eos is not None:
        gen["eos_token_id"] = eos if gen_eos == "same" else gen_eos
    (d / "generation_config.json").write_text(json.dumps(gen))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, d / name)
    return d


def outside_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "outside the vocabulary" in str(w.message)]


@pytest.mark.parametrize("eos, kept", [(OUTSIDE, ()), ([2, OUTSIDE], (2,)), (50279, ())],
                         ids=["vocab+100", "list-valid-and-outside", "olmoe-default-50279"])
def test_an_eos_outside_the_vocabulary_warns_once_and_is_no_stop_id(tmp_path, eos, kept):
    d = olmoe_checkpoint(tmp_path / "m", eos)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cfg = load_config(d)
    msgs = outside_warnings(rec)
    bad = OUTSIDE if eos != 50279 else 50279
    assert len(msgs) == 1, msgs  # config.json and generation_config.json name it: said once
    assert str(bad) in msgs[0] and f"vocab_size {VOCAB}" in msgs[0] and "will not stop" in msgs[0], msgs[0]
    assert cfg.eos_token_ids == kept


def test_it_loads_and_generates(tmp_path, capsys):
    from toolkit.cli import main
    from toolkit.load import load_model

    d = olmoe_checkpoint(tmp_path / "m", [2, OUTSIDE])
    with pytest.warns(UserWarning, match=rf"eos_token_id' {OUTSIDE} is outside the vocabulary \(vocab_size {VOCAB}\)"):
        model, tok = load_model(d, backend="numpy")
    assert model.cfg.eos_token_ids == (2,) and tok.eos_token_ids == (2,)
    capsys.readouterr()
    # the CLI shows a warning as one line naming the command, like an error
    assert main(["generate", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    warned = [s for s in capsys.readouterr().err.splitlines() if "warning" in s]
    assert len(warned) == 1 and warned[0].startswith("moqe generate: warning: ") and "outside the vocabulary" in warned[0]
    d2 = olmoe_checkpoint(tmp_path / "m2", OUTSIDE)  # no stop id left at all: runs to the token limit
    assert main(["generate", "--model", str(d2), "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    assert "moqe generate: warning: " in capsys.readouterr().err


def test_only_generation_config_names_it(tmp_path):
    d = olmoe_checkpoint(tmp_path / "m", 2, gen_eos=[2, OUTSIDE])
    with pytest.warns(UserWarning, match=r"generation_config\.json: 'eos_token_id' " + str(OUTSIDE)):
        assert load_config(d).eos_token_ids == (2,)


@pytest.mark.parametrize("eos, shown", [(-5, "-5"), ([2, -1], "a list"), ("two", "'two'"), (2.0, "2.0"), (True, "True"),
                                        ([2, None], "a list"), ({"a": 1}, "an object")])
def test_negative_or_non_integer_ids_are_refused(tmp_path, eos, shown):
    d = olmoe_checkpoint(tmp_path / "m", 2, gen_eos=None)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "eos_token_id": eos}))
    with pytest.raises(ModelError, match=r"config\.json: 'eos_token_id' must be a non-negative token id "
                                         r"\(or a list of them\), got " + shown.replace(".", r"\.")):
        load_config(d)
    (d / "config.json").write_text(json.dumps(raw))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ModelError, match=r"generation_config\.json: 'eos_token_id' must be a non-negative token id"):
        load_config(d)
