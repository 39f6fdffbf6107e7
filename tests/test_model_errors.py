"""Bad input to the runtime gets a ModelError that names what is wrong (file, tensor, limit)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import tiny_model
from toolkit.errors import ModelError
from toolkit.model import Checkpoint, MoEModel, SamplingParams, generate_tokens, load_config, load_weights


def _load(d, backend="numba"):
    cfg = load_config(d)
    return MoEModel(cfg, load_weights(Checkpoint(d), cfg), backend)


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name):
    return lambda t: t.__setitem__(name, t[name][:-1])


def _nan(name):
    def f(t):
        t[name][0, 3] = np.nan
    return f


# (mutation of the tensors, expected message)
BAD_TENSORS = [
    (_drop("model.layers.1.block_sparse_moe.experts.3.w2.weight"), r"no tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight'"),
    (_drop("model.layers.0.block_sparse_moe.gate.weight"), r"no router for layer 0"),
    (_reshape("model.layers.0.self_attn.k_proj.weight"), r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[31, 64\], the config implies \[32, 64\]"),
    (_nan("model.layers.1.block_sparse_moe.experts.0.w1.weight"), r"'model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight' holds NaN"),
]


@pytest.mark.parametrize("mutate,message", BAD_TENSORS)
def test_bad_tensors(tmp_path, mutate, message):
    d = tiny_model.write(tmp_path / "m", mutate=mutate)
    with pytest.raises(ModelError, match=message):
        _load(d)


BAD_CONFIGS = [
    (lambda c: c.pop("num_local_experts"), r"missing key 'num_local_experts'"),
    (lambda c: c.__setitem__("architectures", ["GPT2LMHeadModel"]), r"not supported; supported: (\w+, )*MixtralForCausalLM"),
    (lambda c: c.__setitem__("rope_scaling", {"rope_type": "longrope"}), r"rope type 'longrope' is not supported"),
]


@pytest.mark.parametrize("mutate,message", BAD_CONFIGS)
def test_bad_configs(tmp_path, mutate, message):
    cfg = dict(tiny_model.CONFIG)
    mutate(cfg)
    d = tiny_model.write(tmp_path / "m", cfg=dict(tiny_model.CONFIG))
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=message):
        _load(d)


def test_config_not_json(tmp_path):
    d = tiny_model.write(tmp_path / "m")
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ModelError, match="config.json: not valid JSON"):
        load_config(d)


def _corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _corrupt_header_offsets(path):
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][1] += 4  # lies: longer than dtype x shape
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(data[8 + n :]))


def _corrupt_header_length(path):
    data = bytearray(path.read_bytes())
    data[:8] = (10**9).to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt,message", [
    (_corrupt_truncate, r"offsets .* lie outside the data"),
    (_corrupt_header_offsets, r"has \d+ bytes, but F32\[.*\] needs"),
    (_corrupt_header_length, r"header length 1000000000 exceeds the file"),
])
def test_malformed_safetensors(tmp_path, corrupt, message):
    d = tiny_model.write(tmp_path / "m")
    corrupt(d / "model.safetensors")
    with pytest.raises(ModelError, match=r"model\.safetensors.*" + message):
        _load(d)


def test_prompt_too_long_and_bad_token_ids(tmp_path):
    m = _load(tiny_model.write(tmp_path / "m"))
    with pytest.raises(ModelError, match="prompt of 60 tokens \\+ 10 new tokens exceeds the context of 64"):
        list(generate_tokens(m, [[3] * 60], SamplingParams(max_new_tokens=10)))
    with pytest.raises(ModelError, match=r"token ids must lie in \[0, 64\)"):
        m.forward(np.array([[3, 64]]), m.new_cache(1, 4))
    with pytest.raises(ModelError, match="at least one token"):
        list(generate_tokens(m, [[]], SamplingParams()))


def test_stop_token_ends_a_sequence_but_not_the_batch(tmp_path):
    m = _load(tiny_model.write(tmp_path / "m"))
    free = [ev.token for ev in generate_tokens(m, [[5, 6, 7]], SamplingParams(max_new_tokens=6))]
    stop = free[2]
    events = list(generate_tokens(m, [[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,))))
    seq0 = [e for e in events if e.seq == 0]
    assert [e.token for e in seq0] == free[: free.index(stop) + 1] and seq0[-1].reason == "stop"
    seq1 = [e for e in events if e.seq == 1]
    assert seq1[-1].done and all(not e.done for e in seq1[:-1])


def test_generation_config_adds_stop_ids(tmp_path):
    d = tiny_model.write(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "temperature": 0.7}))
    cfg = load_config(d)
    assert cfg.eos_token_ids == (2, 7) and cfg.generation["temperature"] == 0.7
    (d / "generation_config.json").write_text("{")
    with pytest.raises(ModelError, match="generation_config.json: not valid JSON"):
        load_config(d)


# Qwen3-MoE / OLMoE parts: a missing or mis-shaped q/k norm, a bad clip_qkv
def _qk_norm_case(tmp_path, cfg, mutate_tensors=None, mutate_cfg=None):
    from safetensors.numpy import load_file, save_file

    from test_uqff_support import tiny_qk_norm_moe

    d = tiny_qk_norm_moe(tmp_path / "m", cfg)
    if mutate_tensors:
        t = load_file(d / "model.safetensors")
        mutate_tensors(t)
        save_file(t, d / "model.safetensors")
    if mutate_cfg:
        c = json.loads((d / "config.json").read_text())
        mutate_cfg(c)
        (d / "config.json").write_text(json.dumps(c))
    return d


QK_NORM_CASES = [
    ("QWEN3_MOE", _drop("model.layers.0.self_attn.k_norm.weight"), None, r"no tensor 'model\.layers\.0\.self_attn\.k_norm\.weight'"),
    ("OLMOE", lambda t: t.__setitem__("model.layers.1.self_attn.q_norm.weight", t["model.layers.1.self_attn.q_norm.weight"][:32]),
     None, r"'model\.layers\.1\.self_attn\.q_norm\.weight' has shape \[32\], the config implies \[64\]"),
    ("OLMOE", None, lambda c: c.__setitem__("clip_qkv", -1), r"'clip_qkv' must be a finite number in \(0"),
    ("QWEN3_MOE", _drop("model.layers.0.self_attn.o_proj.bias"), None, r"no tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"),
]


@pytest.mark.parametrize("family,tensors,config,message", QK_NORM_CASES)
def test_bad_qk_norm_family_inputs(tmp_path, family, tensors, config, message):
    import test_uqff_support

    d = _qk_norm_case(tmp_path, getattr(test_uqff_support, family), tensors, config)
    with pytest.raises(ModelError, match=message):
        _load(d)
