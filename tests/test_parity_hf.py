"""Logits of the runtime against transformers' own implementation (torch on the CPU, eager attention).

Small randomly initialised configs built here: GQA, odd head counts, top-k = 1 and top-k = E, sliding
window, rope scaling, Qwen2-MoE's shared expert / qkv bias / dense layers. Prefill and step-by-step decode
must agree within 1e-4 (max abs, f32 logits) and greedy generations must be token-identical.

Near-ties guard: a top-k choice can flip between implementations when two experts' probabilities are
within rounding. Each case draws seeds until every routing decision of the reference run has a margin of
at least ``MIN_MARGIN`` between the k-th and (k+1)-th probability; the test fails if none is found.
"""
from __future__ import annotations

import json

import numba
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import save_file  # noqa: E402

from toolkit.errors import ModelError  # noqa: E402
from toolkit.model import Checkpoint, MoEModel, SamplingParams, generate_tokens, load_config, load_weights  # noqa: E402

ATOL = 1e-4
MIN_MARGIN = 1e-4
BASE_MIXTRAL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                    initializer_range=0.15, rms_norm_eps=1e-5)
BASE_QWEN = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts=4, num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.15)
BASE_QWEN3 = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=128, initializer_range=0.15)
BASE_OLMOE = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                  initializer_range=0.15, eos_token_id=2, pad_token_id=1)
BASE_DEEPSEEK = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                     topk_group=1, first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=40, qk_rope_head_dim=8,
                     qk_nope_head_dim=16, v_head_dim=12, n_shared_experts=1, max_position_embeddings=128,
                     initializer_range=0.15)  # kv_lora_rank + qk_rope_head_dim = 32: the q8_0 / q4_0 cache applies
BASES = {"MixtralConfig": BASE_MIXTRAL, "Qwen2MoeConfig": BASE_QWEN, "Qwen3MoeConfig": BASE_QWEN3, "OlmoeConfig": BASE_OLMOE,
         "DeepseekV3Config": BASE_DEEPSEEK, "DeepseekV2Config": BASE_DEEPSEEK,
         "Glm4MoeConfig": dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                               n_group=2, topk_group=1, max_position_embeddings=128, initializer_range=0.15)}
BASES["GptOssConfig"] = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                            max_position_embeddings=128, initializer_range=0.15)
YARN_MLA = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}

# name -> (config class, overrides)
CASES = {
    "mixtral-gqa": ("MixtralConfig", {}),
    "mixtral-odd-heads": ("MixtralConfig", dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16)),
    "mixtral-top1": ("MixtralConfig", dict(num_experts_per_tok=1)),
    "mixtral-topE": ("MixtralConfig", dict(num_local_experts=3, num_experts_per_tok=3)),
    "mixtral-sliding-window": ("MixtralConfig", dict(sliding_window=5)),
    "mixtral-hd32-window": ("MixtralConfig", dict(head_dim=32, sliding_window=7)),  # head dim 32: q8_0 / q4_0 caches
    "mixtral-rope-linear": ("MixtralConfig", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mixtral-rope-llama3": ("MixtralConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "mixtral-rope-yarn": ("MixtralConfig", dict(head_dim=16, rope_parameters={  # head_dim: transformers yarn needs it set
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2moe-shared-bias": ("Qwen2MoeConfig", {}),
    "qwen2moe-norm-topk-dense-layer": ("Qwen2MoeConfig", dict(norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3)),
    # Qwen3-MoE: per-head q/k RMSNorm, explicit head_dim (24: H*hd != hidden), no shared expert
    "qwen3moe-head-dim": ("Qwen3MoeConfig", {}),
    "qwen3moe-norm-topk-dense-odd-heads": ("Qwen3MoeConfig", dict(norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=3,
                                                                  num_attention_heads=3, num_key_value_heads=1)),
    "qwen3moe-sparse-step-sliding-bias": ("Qwen3MoeConfig", dict(decoder_sparse_step=2, use_sliding_window=True,
                                                                 sliding_window=5, attention_bias=True, num_experts_per_tok=1)),
    "qwen3moe-topE": ("Qwen3MoeConfig", dict(num_experts=3, num_experts_per_tok=3)),
    # OLMoE: q/k RMSNorm over the whole projection, top-k without renormalisation, optional clip of q, k, v
    "olmoe": ("OlmoeConfig", {}),
    "olmoe-clip-qkv-bias": ("OlmoeConfig", dict(clip_qkv=0.8, attention_bias=True)),
    "olmoe-norm-topk-odd-heads-top1": ("OlmoeConfig", dict(norm_topk_prob=True, hidden_size=96, num_attention_heads=3,
                                                          num_key_value_heads=3, num_experts_per_tok=1)),
    # DeepSeek-V3: MLA (q low-rank, interleaved rope), sigmoid router with a selection bias and groups, a dense
    # first layer, an ungated shared expert, routed_scaling_factor
    "deepseekv3": ("DeepseekV3Config", {}),
    "deepseekv3-q-proj-odd-heads-yarn": ("DeepseekV3Config", dict(q_lora_rank=None, num_attention_heads=3, num_key_value_heads=3,
                                                                  hidden_size=96, rope_interleave=False,
                                                                  n_group=4, topk_group=2, rope_parameters=YARN_MLA)),
    "deepseekv3-top1-ungrouped-bias-two-shared": ("DeepseekV3Config", dict(n_group=1, topk_group=1, num_experts_per_tok=1,
                                                                           attention_bias=True, n_shared_experts=2,
                                                                           norm_topk_prob=False, first_k_dense_replace=0)),
    "deepseekv3-topE": ("DeepseekV3Config", dict(n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1,
                                                 routed_scaling_factor=1.0)),
    # DeepSeek-V2: softmax router, group-limited by the group's best expert, or greedy
    "deepseekv2-group-limited": ("DeepseekV2Config", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                          num_experts_per_tok=3, routed_scaling_factor=1.7)),
    "deepseekv2-greedy-q-proj": ("DeepseekV2Config", dict(q_lora_rank=None, n_group=None, topk_group=None, num_hidden_layers=2)),
    # gpt-oss: attention sinks, q/k/v/o biases, sliding and full layers alternating, yarn (its default rope); router
    # with a logit bias, top-k then softmax; experts with biases and the clamped SwiGLU (gate/up interleaved, in x out)
    "gptoss": ("GptOssConfig", {}),
    "gptoss-clamp-odd-heads-top1": ("GptOssConfig", dict(swiglu_limit=0.8, num_attention_heads=3, num_key_value_heads=1,
                                                         num_experts_per_tok=1, hidden_size=96, num_hidden_layers=3)),
    "gptoss-topE-full-attention": ("GptOssConfig", dict(num_local_experts=3, num_experts_per_tok=3,
                                                        layer_types=["full_attention", "full_attention"])),
    "gptoss-head-dim-32": ("GptOssConfig", dict(head_dim=32)),  # the CUDA kernels' head dims (and the q8_0 cache)
    # GLM-4.5: one record (DeepSeek-V3's MoE parts on GQA) plus partial rotary (rope on half of each head)
    "glm4moe-qk-norm-bias": ("Glm4MoeConfig", dict(use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
                                                   head_dim=32)),  # the CUDA kernels take head dims of 32k
    "glm4moe-odd-heads-top1-dense2": ("Glm4MoeConfig", dict(num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                                                            num_experts_per_tok=1, first_k_dense_replace=2, n_group=1,
                                                            topk_group=1, norm_topk_prob=False)),
}


def _build(case: str, seed: int):
    cls, over = CASES[case]
    base = BASES[cls]
    cfg = getattr(transformers, cls)(**{**base, **over})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    for layer in model.model.layers:  # DeepSeek-V3's selection bias starts at zero: give it values that matter
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.data = torch.randn(bias.shape) * 0.05
        if hasattr(layer.mlp, "router"):  # gpt-oss starts its router and expert biases at zero too
            for b in (layer.mlp.router.bias, layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                b.data = torch.randn(b.shape) * 0.3
    return model


def _margin(scores: np.ndarray, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th largest of each row (inf when k covers the row)."""
    finite = np.sort(scores, axis=-1)[:, ::-1]
    return float((finite[:, k - 1] - finite[:, k]).min()) if k < scores.shape[-1] else np.inf


def _grouped_margins_ok(model, ids: np.ndarray) -> bool:
    """DeepSeek routers: both choices (the groups, then the experts inside them) clear MIN_MARGIN."""
    from toolkit.ref.topk_sigmoid import keep_groups, top2_sum

    cfg, seen = model.config, []
    hooks = [l.mlp.gate.register_forward_hook(lambda m, inp, out: seen.append((m, inp[0].reshape(-1, inp[0].shape[-1]))))
             for l in model.model.layers if hasattr(l.mlp, "gate")]
    with torch.no_grad():
        model(torch.tensor(ids))
    for h in hooks:
        h.remove()
    G, TG, k = cfg.n_group or 1, cfg.topk_group or 1, cfg.num_experts_per_tok
    if getattr(cfg, "topk_method", "group") == "greedy":
        G = TG = 1
    for gate, x in seen:
        logits = (x.float() @ gate.weight.float().T).detach().numpy()
        if hasattr(gate, "e_score_correction_bias"):
            c, rule = 1 / (1 + np.exp(-logits)) + gate.e_score_correction_bias.detach().numpy(), top2_sum
        else:
            c, rule = np.exp(logits - logits.max(-1, keepdims=True)), lambda g: g.max(-1)
            c = c / c.sum(-1, keepdims=True)
        if G > 1 and _margin(rule(c.reshape(len(c), G, -1)), TG) < MIN_MARGIN:
            return False
        if _margin(np.where(np.isinf(kept := keep_groups(c.astype(np.float32), G, TG, rule)), -1e9, kept), k) < MIN_MARGIN:
            return False
    return True


def _margins_ok(model, ids: np.ndarray) -> bool:
    if hasattr(model.config, "n_group"):
        return _grouped_margins_ok(model, ids)
    with torch.no_grad():
        out = model(torch.tensor(ids), output_router_logits=True)
    k = model.config.num_experts_per_tok
    for logits in out.router_logits or ():
        p = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
        if k < p.shape[-1] and (p[:, k - 1] - p[:, k]).min().item() < MIN_MARGIN:
            return False
    return True


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(hf model, checkpoint dir, prompt ids) for a seed without routing near-ties."""
    rng = np.random.default_rng(7)
    for seed in range(20):
        model = _build(request.param, seed)
        ids = rng.integers(3, model.config.vocab_size, (1, 12))
        if _margins_ok(model, ids):
            d = tmp_path_factory.mktemp(request.param)
            model.save_pretrained(d)
            return request.param, model, d, ids
    pytest.fail(f"{request.param}: no seed in 0..19 routes without near-ties; widen the search")


def _ours(d, backend="numba") -> MoEModel:
    cfg = load_config(d)
    return MoEModel(cfg, load_weights(Checkpoint(d), cfg), backend)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_prefill_logits_match(case, backend):
    name, hf, d, ids = case
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits[0].numpy()  # [T, V]
    ours = _ours(d, backend)
    got = ours.forward(ids, ours.new_cache(1, ids.shape[1]))[0]
    assert np.abs(got - ref).max() <= ATOL, f"{name}: max abs diff {np.abs(got - ref).max():.3g}"


def test_decode_step_by_step_matches(case):
    name, hf, d, ids = case
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits[0].numpy()
    ours = _ours(d)
    cache = ours.new_cache(1, ids.shape[1])
    ours.forward(ids[:, :5], cache)
    for t in range(5, ids.shape[1]):
        got = ours.forward(ids[:, t : t + 1], cache)[0, 0]
        assert np.abs(got - ref[t]).max() <= ATOL, f"{name}: step {t} max abs diff {np.abs(got - ref[t]).max():.3g}"


def test_batch_of_different_lengths(case):
    name, hf, d, ids = case
    prompts = [ids[0, :9], ids[0, 2:6]]
    ours = _ours(d)
    tokens = np.zeros((2, 9), np.int64)
    tokens[0], tokens[1, :4] = prompts[0], prompts[1]
    cache = ours.new_cache(2, 10)
    got = ours.forward(tokens, cache, lengths=np.array([9, 4]))
    step = ours.forward(np.array([[5], [7]]), cache)  # one decode step each
    for b, (p, nxt) in enumerate(zip(prompts, (5, 7))):
        with torch.no_grad():
            ref = hf(torch.tensor(np.append(p, nxt)[None])).logits[0].numpy()
        n = len(p)
        assert np.abs(got[b, :n] - ref[:n]).max() <= ATOL, f"{name}: sequence {b} prefill"
        assert np.abs(step[b, 0] - ref[n]).max() <= ATOL, f"{name}: sequence {b} decode"


def test_greedy_generation_token_identical(case):
    name, hf, d, ids = case
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), max_new_tokens=10, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
    ours = _ours(d)
    got = [ev.token for ev in generate_tokens(ours, [list(ids[0])], SamplingParams(max_new_tokens=10))]
    assert got == ref.tolist(), name


@pytest.mark.parametrize("case", [n for n in CASES if n.startswith("mixtral")], indirect=True)
def test_fused_and_sharded_layouts_load_identically(case, tmp_path):
    """transformers 5's fused expert layout and a sharded checkpoint give bit-identical logits."""
    name, hf, d, ids = case
    ck = Checkpoint(d)
    cfg = load_config(d)
    tensors, E = {}, cfg.num_experts
    for k in ck.keys():
        if ".experts." not in k:
            tensors[k] = np.array(ck.get(k))
    for i in range(cfg.num_layers):
        ex = f"model.layers.{i}.block_sparse_moe.experts"
        tensors[f"{ex}.gate_up_proj"] = np.stack([np.concatenate([ck.get(f"{ex}.{e}.w1.weight"), ck.get(f"{ex}.{e}.w3.weight")]) for e in range(E)])
        tensors[f"{ex}.down_proj"] = np.stack([np.array(ck.get(f"{ex}.{e}.w2.weight")) for e in range(E)])
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((d / "config.json").read_text())
    save_file(tensors, str(fused / "model.safetensors"))
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    base = _ours(d)
    want = base.forward(ids, base.new_cache(1, ids.shape[1]))
    for other in (fused, sharded):
        m = _ours(other)
        assert np.array_equal(m.forward(ids, m.new_cache(1, ids.shape[1])), want), other.name


def test_unsupported_architecture_lists_supported(tmp_path):
    from toolkit.families import FAMILIES

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(ModelError, match="LlamaForCausalLM.*supported: " + ", ".join(FAMILIES)) as e:
        load_config(tmp_path)
    assert all(name in str(e.value) for name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                                 "OlmoeForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM",
                                                 "Glm4MoeForCausalLM", "GptOssForCausalLM"))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "rope_parameters" in c[1] and c[0] == "MixtralConfig"])
def test_rope_frequencies_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from toolkit.model.config import config_from_dict

    rope = CASES[name][1]["rope_parameters"]
    cfg = transformers.MixtralConfig(**{**BASE_MIXTRAL, **CASES[name][1]})
    ours = config_from_dict({**json.loads(cfg.to_json_string()), "architectures": ["MixtralForCausalLM"]})
    inv, scale = ours.rope_inv_freq()
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    np.testing.assert_allclose(inv, ref_inv.numpy(), rtol=1e-6)
    assert scale == pytest.approx(ref_scale, rel=1e-6)


@pytest.mark.parametrize("case", ["mixtral-gqa", "qwen2moe-shared-bias"], indirect=True)
@pytest.mark.parametrize("window,stride", [(64, 32), (16, 6), (10, 10)])
def test_sliding_window_perplexity_matches_transformers(case, window, stride):
    """Token j is scored once, by the first window that holds it past its first position: context
    ``seq[begin_j : j]`` with ``begin_j`` the smallest multiple of the stride such that begin + window > j.
    With stride == window (disjoint windows) a window's first token has no context and is not scored."""
    from toolkit.model import perplexity

    name, hf, d, ids = case
    seq = np.random.default_rng(3).integers(3, hf.config.vocab_size, 40)
    nll = []
    for j in range(1, len(seq)):
        begin = max(0, -(-(j - window + 1) // stride)) * stride
        if begin == j:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor(seq[None, begin:j])).logits[0, -1].double()
        nll.append(float(torch.logsumexp(logits, 0) - logits[seq[j]]))
    got = perplexity(_ours(d), list(seq), window, stride)
    assert got["tokens"] == len(nll)
    assert got["perplexity"] == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-5)


# ---- the newer families quantized: NumPy and Numba agree, and a UQFF round trip changes nothing --------------
FAMILY_CASES = [n for n in CASES if n.split("-")[0] in ("qwen3moe", "olmoe", "deepseekv3", "deepseekv2", "glm4moe", "gptoss")]


@pytest.mark.parametrize("case", FAMILY_CASES, indirect=True)
@pytest.mark.parametrize("fmt", ["int4", "q4_0"])
def test_family_quantized_backends_agree_and_uqff_round_trips(case, fmt, tmp_path):
    from test_uqff_support import _with_tokenizer
    from toolkit.load import load_model
    from toolkit.quant import parse_policy
    from toolkit.uqff import load_bundle, save_bundle

    name, _, d, ids = case
    _with_tokenizer(d)  # load_model and bundles carry a tokenizer
    policy = parse_policy("moqe", fmt)
    got = {}
    for backend in ("numpy", "numba"):
        m, _ = load_model(d, backend=backend, policy=policy)
        got[backend] = m.forward(ids, m.new_cache(1, ids.shape[1]))
    err = np.abs(got["numba"] - got["numpy"]).max()
    assert err <= ATOL, f"{name} moqe {fmt}: numba vs numpy max abs diff {err:.3g}"
    save_bundle(d, tmp_path / "b", policy)
    m, _ = load_bundle(tmp_path / "b")
    assert np.array_equal(m.forward(ids, m.new_cache(1, ids.shape[1])), got["numba"]), f"{name}: UQFF round trip changed logits"


# ---- DeepSeek's parts: the latent KV cache, bad input, moqe info ---------------------------------------------
@pytest.mark.parametrize("case", ["deepseekv3"], indirect=True)
def test_mla_latent_cache_quantized(case):
    """The q8_0 / q4_0 cache holds MLA's latent rows (one per token and layer, read as key and value): NumPy (the
    spec: blocks decoded, then dense attention) and Numba agree; the logits move from the f32 cache's by about
    what a GQA cache moves them on these sharp random models (q8_0: 2.7 % of the largest logit on a Mixtral-
    shaped one), q4_0 more than q8_0; the bytes are one row's blocks."""
    from toolkit.model.kv_cache import cache_bytes_per_token

    name, _, d, ids = case
    cfg = load_config(d)
    base = _ours(d)
    want = base.forward(ids, base.new_cache(1, ids.shape[1]))[0, 6:]
    drift = {}
    for kv in ("q8_0", "q4_0"):
        got = {}
        for backend in ("numpy", "numba"):
            m = _ours(d, backend)
            m.kv_types = (kv, kv)
            cache = m.new_cache(1, ids.shape[1])
            m.forward(ids[:, :6], cache)
            got[backend] = np.concatenate([m.forward(ids[:, t:t + 1], cache)[0] for t in range(6, ids.shape[1])])
        assert np.abs(got["numba"] - got["numpy"]).max() <= ATOL, f"{kv}: numba vs numpy"
        drift[kv] = np.abs(got["numba"] - want).max() / np.abs(want).max()
        r = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim  # 32: one block per row
        assert cache.bytes_per_token == cfg.num_layers * {"q8_0": 34, "q4_0": 18}[kv] * r // 32
        assert cache.bytes_per_token == cache_bytes_per_token(cfg.num_layers, *cfg.kv_layout[:2], (kv, kv), True)
    assert 0 < drift["q8_0"] <= 0.05 and drift["q8_0"] < drift["q4_0"] <= 1.0, drift
    m.kv_types = ("q8_0", "q4_0")
    with pytest.raises(ModelError, match="one latent row per token.*give one cache type"):
        m.new_cache(1, 4)


def _mutated(d, tmp_path, tensors=None, config=None):
    import shutil

    from safetensors.numpy import load_file

    out = tmp_path / "m"
    shutil.copytree(d, out)
    if config:
        c = json.loads((out / "config.json").read_text())
        config(c)
        (out / "config.json").write_text(json.dumps(c))
    if tensors:
        t = load_file(out / "model.safetensors")
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
    return out


DEEPSEEK_BAD_INPUT = [
    (None, lambda c: c.pop("kv_lora_rank"), r"missing key 'kv_lora_rank'"),
    (None, lambda c: c.update(n_group=3), r"n_routed_experts \(8\) must be a multiple of n_group \(3\)"),
    (None, lambda c: c.update(num_experts_per_tok=5), r"num_experts_per_tok \(5\) exceeds the 4 experts of the topk_group \(1\) best groups"),
    (lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"), None,
     r"no tensor 'model\.layers\.1\.mlp\.gate\.e_score_correction_bias'"),
    (lambda t: t.update({"model.layers.2.self_attn.kv_b_proj.weight": np.zeros((112, 20), np.float32)}), None,
     r"'model\.layers\.2\.self_attn\.kv_b_proj\.weight' has shape \[112, 20\], the config implies \[112, 24\]"),
    (lambda t: t.pop("model.layers.0.self_attn.q_a_layernorm.weight"), None, r"no tensor 'model\.layers\.0\.self_attn\.q_a_layernorm\.weight'"),
]


def _mxfp4_gate_up(t, blocks_shape):  # layer 0's gate_up stored as MXFP4 blocks of a given shape
    t.pop("model.layers.0.mlp.experts.gate_up_proj")
    t["model.layers.0.mlp.experts.gate_up_proj_blocks"] = np.zeros(blocks_shape, np.uint8)
    t["model.layers.0.mlp.experts.gate_up_proj_scales"] = np.full(blocks_shape[:-1], 127, np.uint8)


GPTOSS_BAD_INPUT = [
    (lambda t: t.pop("model.layers.1.self_attn.sinks"), None, r"no tensor 'model\.layers\.1\.self_attn\.sinks'"),
    (lambda t: _mxfp4_gate_up(t, (4, 64, 3, 16)), None,
     r"'model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks' has shape \[4, 64, 3, 16\], the config implies \[4, 64, 2, 16\]"),
    (lambda t: (_mxfp4_gate_up(t, (4, 64, 2, 16)), t["model.layers.0.mlp.experts.gate_up_proj_scales"].__setitem__(
        (1, 2, 0), 255)), None, r"gate_up_proj_scales' holds the e8m0 NaN code 255"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj": np.zeros((4, 64, 32), np.float32)}), None,
     r"'model\.layers\.0\.mlp\.experts\.down_proj' has shape \[4, 64, 32\], the config implies \[4, 32, 64\]"),
    (None, lambda c: c.update(swiglu_limit=0), r"'swiglu_limit' must be a finite number in \(0"),
]
BAD_INPUT = [("deepseekv3", *row) for row in DEEPSEEK_BAD_INPUT] + [("gptoss", *row) for row in GPTOSS_BAD_INPUT]


@pytest.mark.parametrize("case,tensors,config,message", BAD_INPUT, indirect=["case"])
def test_family_bad_input_names_the_key_or_tensor(case, tmp_path, tensors, config, message):
    d = _mutated(case[2], tmp_path, tensors, config)
    with pytest.raises(ModelError, match=message):
        _ours(d)


@pytest.mark.parametrize("case", ["deepseekv3", "deepseekv2-group-limited"], indirect=True)
def test_moqe_info_prints_the_parts_and_the_latent_cache(case, capsys):
    from toolkit.cli import main

    name, hf, d, _ = case
    assert main(["info", "--model", str(d)]) == 0
    out = capsys.readouterr().out
    assert "MLA (absorbed)" in out and "latent 24 + rope key 8" in out
    assert ("sigmoid with a selection bias" if name == "deepseekv3" else "softmax, top-3 in the best 2 of 4 groups") in out
    c = hf.config  # f32 latent row: 32 floats per layer; the expanded per-head K and V: H * (24 + 12) floats
    assert f"|      f32 |             {4 * 32 * c.num_hidden_layers} |" in out
    assert str(4 * c.num_hidden_layers * c.num_attention_heads * (24 + 12)) in out


@pytest.mark.parametrize("case", ["glm4moe-qk-norm-bias"], indirect=True)
def test_glm4moe_info(case, capsys):
    """GLM-4.5 is DeepSeek-V3's MoE parts on GQA plus one new part, partial rotary: moqe info says so."""
    from toolkit.cli import main

    _, _, d, _ = case
    assert main(["info", "--model", str(d)]) == 0
    out = capsys.readouterr().out
    assert "GQA, RMSNorm on each head's q and k, q/k/v biases" in out and "on 16 of 32 head dims" in out
    assert "sigmoid with a selection bias, top-2 in the best 1 of 2 groups" in out and "x2.5" in out


# ---- gpt-oss's MXFP4 experts, read as stored -------------------------------------------------------------------
@pytest.mark.parametrize("case", ["gptoss"], indirect=True)
def test_gptoss_mxfp4_checkpoint_loads_natively_and_matches_transformers(case, tmp_path):
    """A checkpoint with the released layout (``*_blocks`` / ``*_scales``) loads as MXFP4 QTensors (never a
    dequantized copy); their decode equals transformers' own MXFP4 dequantization bit for bit, and the logits
    match transformers run on those dequantized experts."""
    from safetensors.numpy import load_file

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from toolkit.formats import QTensor, get_format
    from toolkit.formats.ggml import mxfp4_blocks_to_ocp

    import copy

    name, hf, d, ids = case
    hf = copy.deepcopy(hf)  # the case's model is shared by the module: change a copy
    fmt = get_format("mxfp4")
    tensors = load_file(d / "model.safetensors")
    for i in range(hf.config.num_hidden_layers):
        ex = f"model.layers.{i}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            w = tensors.pop(f"{ex}.{proj}")  # [E, in, out]
            q = fmt.quantize(np.ascontiguousarray(w.transpose(0, 2, 1)), "numpy")  # [E, out, in]
            blocks, scales = mxfp4_blocks_to_ocp(q.arrays["blocks"])
            tensors[f"{ex}.{proj}_blocks"], tensors[f"{ex}.{proj}_scales"] = blocks, scales
            deq = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32)  # [E, in, out]
            assert np.array_equal(deq.numpy(), q.dequantize("numpy").transpose(0, 2, 1)), f"{ex}.{proj}"
            getattr(hf.model.layers[i].mlp.experts, proj).data = deq
    out = tmp_path / "mxfp4"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    save_file(tensors, str(out / "model.safetensors"))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits[0].numpy()
    for backend in ("numpy", "numba"):
        m = _ours(out, backend)
        assert all(isinstance(w, QTensor) for l in load_weights(Checkpoint(out), load_config(out)).layers
                   for w in (l.moe["gate_up"], l.moe["down"]))
        got = m.forward(ids, m.new_cache(1, ids.shape[1]))[0]
        assert np.abs(got - ref).max() <= ATOL, f"{backend}: {np.abs(got - ref).max():.3g}"


@pytest.mark.parametrize("case", ["gptoss", "deepseekv3", "deepseekv2-greedy-q-proj", "glm4moe-qk-norm-bias",
                                  "qwen2moe-shared-bias", "qwen3moe-head-dim", "olmoe-clip-qkv-bias", "mixtral-gqa"], indirect=True)
def test_parameter_count_from_the_config_matches_the_checkpoint(case):
    """``moqe info``'s config-only count (used for the memory check before loading) equals the tensors held."""
    from toolkit.model.inspect import parameter_count

    name, hf, d, _ = case
    held = sum(int(np.prod(Checkpoint(d).get(k).shape)) for k in Checkpoint(d).keys())
    assert sum(parameter_count(load_config(d)).values()) == held, name


CUDA_FAMILY_CASES = [("gptoss-head-dim-32", "none", None, "f32"), ("gptoss-head-dim-32", "moqe", "mxfp4", "q8_0"),
                     ("deepseekv3", "none", None, "f32"), ("deepseekv3", "moqe", "int4", "q8_0"),
                     ("deepseekv2-group-limited", "moqe", "q4_0", "f32"),
                     ("deepseekv3-q-proj-odd-heads-yarn", "none", None, "q4_0"),
                     ("glm4moe-qk-norm-bias", "moqe", "int4", "f32")]


@pytest.mark.parametrize("case,preset,fmt,kv", CUDA_FAMILY_CASES, indirect=["case"])
def test_family_on_the_emulated_cuda_device(case, preset, fmt, kv, monkeypatch):
    """The newer families' parts on the CUDA backend (kernels emulated on the CPU), the same logits as the NumPy
    backend, prefill and decode: gpt-oss (sinks in kv_attention, the router's logit bias, expert biases through
    moe_bias_add, the clamped SwiGLU), DeepSeek (mla_q / mla_kv / mla_out around kv_attention over 32-wide latent
    rows shared by K and V, topk_sigmoid / topk_softmax_grouped, ungated shared experts, dense first layers), GLM-4.5
    (partial rotary in the rope kernel). The decode steps are recorded plans with their dense GEMMs on
    cuda_src/linear.cu, as a GPU runs them (``linear_kernel``: every projection's input as that kernel takes it)."""
    from test_uqff_support import _with_tokenizer
    from toolkit.gpu.device import device
    from toolkit.load import load_model
    from toolkit.quant import parse_policy

    name, _, d, ids = case
    _with_tokenizer(d)
    policy = parse_policy(preset, fmt) if fmt else None
    monkeypatch.setattr(device("cuda-emu"), "linear_kernel", True)
    got = {}
    for backend in ("numpy", "cuda-emu"):
        m, _ = load_model(d, backend=backend, policy=policy, kv_cache=kv)
        cache = m.new_cache(1, ids.shape[1])
        pre = m.rt.host(m.forward(ids[:, :8], cache))[0]
        steps = [m.rt.host(m.decode(ids[:, t], cache))[0] for t in range(8, ids.shape[1])]
        if backend == "cuda-emu":
            assert "linear_f32" in m.rt.device.launched
        got[backend] = np.concatenate([pre, np.stack(steps)])
    tol = 1e-4 if kv == "f32" else 1e-2  # a q8_0 cache written from last-ulp-different keys can flip one code
    assert np.abs(got["cuda-emu"] - got["numpy"]).max() <= tol, np.abs(got["cuda-emu"] - got["numpy"]).max()


# Routed experts placed on the host (toolkit/model/placement.py): the families' own expert parts (DeepSeek-V3:
# grouped sigmoid router, shared expert, a leading dense layer; gpt-oss: expert biases, clamped SwiGLU) split across the
# bus on the emulated device, logits equal to the NumPy backend's. Placements: all on the host; the first layers'
# (llama.cpp's --n-cpu-moe: layer indices, DeepSeek's dense layer 0 included); a per-expert file splitting every MoE layer.
# Qwen3-MoE and OLMoE: tests/test_placement.py (head dims the CUDA kernels take).
PLACEMENT_CASES = [(c, f, p) for c, f in (("deepseekv3", "int4"), ("deepseekv3", None),
                                          ("gptoss-head-dim-32", "mxfp4"), ("gptoss-head-dim-32", None))
                   for p in ("cpu-moe", "n-cpu-moe", "file")]


@pytest.mark.parametrize("case,fmt,place", PLACEMENT_CASES, indirect=["case"])
def test_family_with_experts_on_the_host_on_the_emulated_device(case, fmt, place, tmp_path):
    """Prefill of a batch of two prompts of different lengths, then decode steps of both, on the emulated device
    with routed experts on the host, against the NumPy backend (every expert where it computes)."""
    from test_uqff_support import _with_tokenizer
    from toolkit.load import load_model
    from toolkit.model.placement import PlacementSpec
    from toolkit.quant import parse_policy

    name, _, d, ids = case
    _with_tokenizer(d)
    cfg = load_config(d)
    moe = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    if place == "file":  # every MoE layer split: even experts of the first, the last two of the others
        E = cfg.num_experts
        lines = [f"layers.{i}.experts.{e}=host" for k, i in enumerate(moe) for e in range(E)
                 if (e % 2 == 0 if k == 0 else e >= E - 2)]
        (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
        spec = PlacementSpec(file=str(tmp_path / "p.txt"))
    else:
        spec = PlacementSpec(cpu_moe=True) if place == "cpu-moe" else PlacementSpec(n_cpu_moe=moe[0] + 1)
    policy = parse_policy("moqe", fmt) if fmt else None
    got = {}
    for backend in ("numpy", "cuda-emu"):
        m, _ = load_model(d, backend=backend, policy=policy, placement=spec if backend != "numpy" or place == "cpu-moe" else None,
                          activations="f32")
        if backend == "cuda-emu":
            split = [i for i, l in enumerate(m.layers) if getattr(getattr(l.ffn, "experts", None), "host", None) is not None]
            assert split == (moe if place != "n-cpu-moe" else moe[:1]), split
        # a batch of two prompts of different lengths (8 and 5 tokens), then decode steps for both
        tokens = np.stack([ids[0, :8], np.r_[ids[0, 3:8][::-1], 0, 0, 0]])
        cache = m.new_cache(2, ids.shape[1])
        pre = m.rt.host(m.forward(tokens, cache, lengths=np.array([8, 5])))  # [2, 8, V]
        steps = [m.rt.host(m.decode(np.stack([ids[0, t], ids[0, t - 3]]), cache)) for t in range(8, ids.shape[1])]
        got[backend] = np.concatenate([pre[0], pre[1, :5], *steps])
    assert np.abs(got["cuda-emu"] - got["numpy"]).max() <= 1e-4, np.abs(got["cuda-emu"] - got["numpy"]).max()


# ---- the compiled decode step (toolkit/model/decode_step.py): the same bits as the staged stages ---------------
# (case, preset, format, KV cache, layers the compiled step covers). A layer it does not cover runs staged.
COMPILED_CASES = [("mixtral-gqa", "none", None, "f32", 2), ("mixtral-hd32-window", "moqe", "int4", "q8_0", 2),
                  ("mixtral-hd32-window", "none", None, "q4_0", 2), ("mixtral-hd32-window", "moqe", "int8", "k=q8_0,v=q4_0", 2),
                  ("mixtral-hd32-window", "moqe", "int3", "f32", 2), ("mixtral-odd-heads", "none", None, "f32", 2), ("mixtral-topE", "moqe", "q8_0", "f32", 2),
                  ("qwen2moe-shared-bias", "moqe", "q4_0", "f32", 2),
                  ("qwen2moe-norm-topk-dense-layer", "none", None, "f32", 2),  # layer 1 of 3 is a dense MLP
                  ("qwen3moe-head-dim", "moqe", "q8_0", "f32", 2), ("qwen3moe-sparse-step-sliding-bias", "none", None, "f32", 1),
                  ("olmoe-clip-qkv-bias", "moqe", "int2", "f32", 2),
                  # not covered: MLA, grouped routers, sinks / router bias / expert biases, W8A8, quantized attention
                  ("deepseekv3", "none", None, "f32", 0), ("glm4moe-qk-norm-bias", "none", None, "f32", 0),
                  ("gptoss-head-dim-32", "none", None, "f32", 0), ("mixtral-gqa", "moqe", "fp8", "f32", 0),
                  ("mixtral-gqa", "all-linear", "int8", "f32", 0)]
# experts on int8 activations (--activations int8): the step's integer one-row kernel against the staged igemm
INT8_COMPILED_CASES = [("mixtral-hd32-window", "moqe", "int4", "q8_0", 2), ("mixtral-topE", "moqe", "q8_0", "f32", 2),
                       ("qwen2moe-shared-bias", "moqe", "q4_0", "f32", 2), ("olmoe-clip-qkv-bias", "moqe", "int2", "f32", 2),
                       ("qwen3moe-head-dim", "moqe", "int8", "f32", 2)]


@pytest.mark.parametrize("case,preset,fmt,kv,covered,act",
                         [c + ("f32",) for c in COMPILED_CASES] + [c + ("int8",) for c in INT8_COMPILED_CASES],
                         indirect=["case"])
def test_compiled_decode_step_gives_the_staged_bits(case, preset, fmt, kv, covered, act, monkeypatch):
    """Decode steps through the compiled per-layer step ("on": compiled here if needed) and through the staged
    stages ("off") give identical logits, bit for bit, and both stay within ATOL of transformers; the layers
    it covers are the ones listed."""
    from test_uqff_support import _with_tokenizer
    from toolkit.cpu import moe_gemm
    from toolkit.load import load_model
    from toolkit.model.decode_step import covers
    from toolkit.quant import parse_policy

    name, hf, d, ids = case
    _with_tokenizer(d)
    monkeypatch.setattr(moe_gemm, "DEFAULT_ACTIVATIONS", act)
    m, _ = load_model(d, policy=parse_policy(preset, fmt) if fmt else None, kv_cache=kv)
    if act == "int8":
        assert all(moe_gemm.int8_applies(w) for layer in m.layers for w in layer.ffn.expert_weights), name
    assert sum(covers(layer) for layer in m.layers) == covered, name
    got = {}
    for mode in ("off", "on"):
        m.compiled_decode = mode
        cache = m.new_cache(1, ids.shape[1])
        m.forward(ids[:, :5], cache)
        got[mode] = np.stack([m.forward(ids[:, t:t + 1], cache)[0, 0] for t in range(5, ids.shape[1])])
    assert np.array_equal(got["on"], got["off"]), f"{name}: max abs diff {np.abs(got['on'] - got['off']).max():.3g}"
    if preset == "none" and kv == "f32":
        with torch.no_grad():
            ref = hf(torch.tensor(ids)).logits[0].numpy()[5:]
        assert np.abs(got["on"] - ref).max() <= ATOL, name


# a 16-bit checkpoint: attention's projections held in its own type (Runtime.dense), on the plain 16-bit GEMV
# (small weights) or, with the parallel threshold at 0, on the format's template GEMV (a real model's size)
SIXTEEN_CASES = [("mixtral-hd32-window", "float16", False, None), ("mixtral-hd32-window", "bfloat16", True, "q4_0"),
                 ("qwen3moe-head-dim", "float16", True, None)]


@pytest.mark.parametrize("case,dtype,template,fmt", SIXTEEN_CASES, indirect=["case"])
def test_16bit_attention_runs_compiled_with_the_staged_bits(case, dtype, template, fmt, tmp_path, monkeypatch):
    """A checkpoint saved in f16 / bf16 keeps attention's q|k|v and o in that type on numba (half the bytes);
    the compiled decode step covers it and gives the staged bits; the logits match transformers on the same
    16-bit weights computed in f32."""
    import copy

    from test_uqff_support import _with_tokenizer
    from toolkit.cpu import qlinear
    from toolkit.load import load_model
    from toolkit.model import runtime
    from toolkit.model.decode_step import covers
    from toolkit.quant import parse_policy

    name, hf, _, ids = case
    hf16 = copy.deepcopy(hf).to(getattr(torch, dtype))
    hf16.save_pretrained(tmp_path)
    _with_tokenizer(tmp_path)
    monkeypatch.setattr(runtime, "DENSE16_MIN", 0)  # a tiny model's projections held 16-bit as a real model's
    if template:
        monkeypatch.setattr(qlinear, "ONE_ROW_16_MAX", 0)
    m, _ = load_model(tmp_path, policy=parse_policy("moqe", fmt) if fmt else None, kv_cache="f32")
    want = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for layer in m.layers:
        assert layer.attn.qkv.weight.fmt.name == want and layer.attn.o.weight.fmt.name == want, name
        assert covers(layer), name
    got = {}
    for mode in ("off", "on"):
        m.compiled_decode = mode
        cache = m.new_cache(1, ids.shape[1])
        pre = m.forward(ids[:, :5], cache)[0]
        got[mode] = np.concatenate([pre, np.stack([m.forward(ids[:, t:t + 1], cache)[0, 0]
                                                   for t in range(5, ids.shape[1])])])
    assert m.decode_paths["compiled"] > 0, name
    assert np.array_equal(got["on"], got["off"]), f"{name}: max abs diff {np.abs(got['on'] - got['off']).max():.3g}"
    if fmt is None:  # transformers in f32 on the 16-bit weights (its buffers, rope's inv_freq, left in f32)
        ref_model = copy.deepcopy(hf)
        with torch.no_grad():
            for p in ref_model.parameters():
                p.copy_(p.to(getattr(torch, dtype)).float())
            ref = ref_model(torch.tensor(ids)).logits[0].numpy()
        assert np.abs(got["on"] - ref).max() <= ATOL, f"{name}: max abs diff {np.abs(got['on'] - ref).max():.3g}"


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="the parallel build needs 2 threads")
@pytest.mark.parametrize("case,fmt,kv,act", [("mixtral-hd32-window", "q4_0", "q8_0", "f32"),
                                              ("mixtral-hd32-window", "q4_0", "q8_0", "int8"),
                                              ("qwen3moe-head-dim", None, "f32", "f32")], indirect=["case"])
def test_parallel_decode_step_gives_the_serial_bits(case, fmt, kv, act, monkeypatch):
    """The compiled step's parallel build (a layer big enough to split, more than one thread) gives the serial
    build's logits bit for bit, and it is the build that ran."""
    from test_uqff_support import _with_tokenizer
    from toolkit.cpu import moe_gemm
    from toolkit.load import load_model
    from toolkit.cpu import api as cpu_api
    from toolkit.quant import parse_policy
    from toolkit.threads import set_threads, threads

    name, hf, d, ids = case
    _with_tokenizer(d)
    monkeypatch.setattr(moe_gemm, "DEFAULT_ACTIVATIONS", act)
    m, _ = load_model(d, policy=parse_policy("moqe", fmt) if fmt else None, kv_cache=kv)
    before = threads()
    got = {}
    try:
        for n in (1, 2):
            set_threads(n)
            monkeypatch.setattr(cpu_api, "PARALLEL_MIN_WORK", 0)  # every layer "big enough" at 2 threads
            cache = m.new_cache(1, ids.shape[1])
            m.forward(ids[:, :5], cache)
            got[n] = np.stack([m.forward(ids[:, t:t + 1], cache)[0, 0] for t in range(5, ids.shape[1])])
    finally:
        set_threads(before)
    assert all(any(k[2] for k in s.builds) and any(not k[2] for k in s.builds) for s in m._steps), name
    assert np.array_equal(got[1], got[2]), f"{name}: max abs diff {np.abs(got[1] - got[2]).max():.3g}"


def test_cached_mode_never_compiles():
    """``ready`` without compile: False for a build that is neither in the process nor on disk, and nothing is
    compiled; with compile, True and compiled."""
    from numba import njit

    from toolkit.cpu._jit import ready

    fn = njit(cache=False)(lambda a: a + 1)
    assert not ready(fn, (np.ones(2),), compile=False) and not fn.signatures
    assert ready(fn, (np.ones(2),), compile=True) and len(fn.signatures) == 1
    assert ready(fn, (np.ones(2),), compile=False)
