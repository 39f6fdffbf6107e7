"""Supported MoE architectures as data: config keys, tensor names, routing rules.

One record per family; the runtime reads these fields and never branches on the family's name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..errors import ModelError


def _all_moe(k, n_layers: int, n_experts: int) -> tuple[tuple, tuple]:
    """Every layer routed; one sliding window (0 = full attention) for all. ``k``: a schema.Keys."""
    window = k.int("sliding_window", 0)
    return (True,) * n_layers, (window,) * n_layers


def _qwen2_moe_layers(k, n_layers: int, n_experts: int) -> tuple[tuple, tuple]:
    only_mlp = set(k.int_list("mlp_only_layers", 0, n_layers - 1))
    step = k.int("decoder_sparse_step", 1)
    moe = tuple(i not in only_mlp and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers))
    window = k.int("sliding_window", 0)
    types = k.str_list("layer_types", ("full_attention", "sliding_attention"))
    if types:
        if len(types) < n_layers:
            raise ModelError(f"{k.source}: 'layer_types' lists {len(types)} layers, num_hidden_layers is {n_layers}")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types[:n_layers])
    elif k.bool("use_sliding_window", False):
        first = k.int("max_window_layers", 0)
        windows = tuple(window if i >= first else 0 for i in range(n_layers))
    else:
        windows = (0,) * n_layers
    return moe, windows


def _deepseek_layers(k, n_layers: int, n_experts: int) -> tuple[tuple, tuple]:
    """Dense MLPs in the first ``first_k_dense_replace`` layers, then a routed block every ``moe_layer_freq``
    layers (1 in every released DeepSeek-V2/V3); full attention everywhere."""
    first, freq = k.int("first_k_dense_replace", 0, lo=0, hi=n_layers), k.int("moe_layer_freq", 1, lo=1, hi=1024)
    moe = tuple(n_experts > 0 and i >= first and i % freq == 0 for i in range(n_layers))
    return moe, (0,) * n_layers


def _shared_sized(key: str, count_key: str | None = None):
    """The shared expert's intermediate size: ``key`` (Qwen2-MoE), or ``key`` times ``count_key`` shared
    experts run as one MLP (DeepSeek: ``moe_intermediate_size * n_shared_experts``); 0 for none."""

    def size(k) -> int:
        n = k.int(key, 0, limit="intermediate_size")
        return n * k.int(count_key, 0, lo=0, hi=1024) if count_key else n

    return size


@dataclass(frozen=True)
class Architecture:
    name: str  # the class name in config.json's "architectures"
    num_experts_key: str
    expert_intermediate_key: str
    shared_size: Callable | None  # keys -> the shared expert's intermediate size (None: the family has none)
    norm_topk_default: bool  # renormalise the top-k routing weights (when the config does not say)
    norm_topk_fixed: bool | None  # the family always (True) does it, whatever the config says
    qkv_bias_default: bool
    moe_prefixes: tuple[str, ...]  # module path of the MoE block inside a layer, in checkpoint order of preference
    expert_names: tuple[str, str, str]  # per-expert layout: (gate, up, down) projection names
    layer_kinds: Callable[[object, int, int], tuple[tuple, tuple]]  # (keys, layers, experts) -> (is MoE per layer,
    #                                                                   sliding window per layer)
    # attention part: "gqa" (Mixtral, Qwen2-MoE), "gqa-qk-norm-head" (an RMSNorm over each head's q and k,
    # Qwen3-MoE), "gqa-qk-norm-proj" (an RMSNorm over the whole q and k projections, OLMoE), "mla" (DeepSeek's
    # multi-head latent attention: the cache holds one compressed latent plus the rope key per token)
    attention: str = "gqa"
    # router part, one op each: "softmax" (topk_softmax: softmax, top-k, optional renormalisation),
    # "sigmoid-grouped" (topk_sigmoid: sigmoid scores, a selection bias, group-limited top-k, DeepSeek-V3),
    # "softmax-grouped" (topk_softmax_grouped: softmax, group-limited top-k by group max, DeepSeek-V2)
    router: str = "softmax"
    select_bias_name: str | None = None  # the router's selection-bias tensor, next to its weight
    router_module: str = "gate"  # the router's module inside the MoE block
    router_logit_bias: bool = False  # the router linear has a bias (gpt-oss)
    # expert part: "swiglu" (silu(gate) * up, no biases) or "clamped-swiglu" (gpt-oss: biases on both projections,
    # gate/up clamped to swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate)); expert_layout "stacked"
    # (per expert, or transformers 5's fused [E, 2I, D]) or "gpt-oss" ([E, D, 2I] with gate/up interleaved on the
    # last axis, [E, I, D] down; or MXFP4 *_blocks / *_scales, read natively)
    experts: str = "swiglu"
    expert_layout: str = "stacked"
    sinks: bool = False  # attention sinks: one learned logit per head in the softmax denominator (gpt-oss)
    shared_names: tuple[str, str | None] = ("shared_expert", "shared_expert_gate")  # shared MLP module, its
    #                                                       sigmoid gate's module (None: the shared expert is ungated)
    bias_key: str = "qkv_bias"  # the config key switching the attention biases on
    o_bias: bool = False  # the bias key covers o_proj too (transformers' ``attention_bias``)
    clip_qkv_key: str | None = None  # q, k, v clamped to [-c, c] after the norms when the config sets it
    qk_norm_key: str | None = None  # a config switch for per-head q/k RMSNorm on a "gqa" part (GLM-4.5's use_qk_norm)
    num_experts_aliases: tuple[str, ...] = ()  # other names of num_experts_key (transformers 5 writes
    #                                            Qwen3-MoE's num_experts as num_local_experts)

    def experts_key(self, raw: dict) -> str:
        """The key that holds the expert count in this config (the record's own name when none is present)."""
        return next((key for key in (self.num_experts_key, *self.num_experts_aliases) if raw.get(key) is not None),
                    self.num_experts_key)

    @property
    def shared_gated(self) -> bool:
        return self.shared_names[1] is not None

    @property
    def qk_norm(self) -> str | None:
        """'head', 'proj' or None: where the attention part normalises q and k."""
        return {"gqa-qk-norm-head": "head", "gqa-qk-norm-proj": "proj"}.get(self.attention)


MIXTRAL = Architecture(
    name="MixtralForCausalLM", num_experts_key="num_local_experts", expert_intermediate_key="intermediate_size",
    shared_size=None, norm_topk_default=True, norm_topk_fixed=True, qkv_bias_default=False,
    moe_prefixes=("block_sparse_moe", "mlp"), expert_names=("w1", "w3", "w2"), layer_kinds=_all_moe,
)
QWEN2_MOE = Architecture(
    name="Qwen2MoeForCausalLM", num_experts_key="num_experts", expert_intermediate_key="moe_intermediate_size",
    shared_size=_shared_sized("shared_expert_intermediate_size"), norm_topk_default=False, norm_topk_fixed=None,
    qkv_bias_default=True, moe_prefixes=("mlp",), expert_names=("gate_proj", "up_proj", "down_proj"),
    layer_kinds=_qwen2_moe_layers,
)
QWEN3_MOE = Architecture(
    name="Qwen3MoeForCausalLM", num_experts_key="num_experts", expert_intermediate_key="moe_intermediate_size",
    shared_size=None, norm_topk_default=False, norm_topk_fixed=None, qkv_bias_default=False,
    moe_prefixes=("mlp",), expert_names=("gate_proj", "up_proj", "down_proj"), layer_kinds=_qwen2_moe_layers,
    attention="gqa-qk-norm-head", bias_key="attention_bias", o_bias=True, num_experts_aliases=("num_local_experts",),
)
OLMOE = Architecture(
    name="OlmoeForCausalLM", num_experts_key="num_experts", expert_intermediate_key="intermediate_size",
    shared_size=None, norm_topk_default=False, norm_topk_fixed=None, qkv_bias_default=False,
    moe_prefixes=("mlp",), expert_names=("gate_proj", "up_proj", "down_proj"), layer_kinds=_all_moe,
    attention="gqa-qk-norm-proj", bias_key="attention_bias", o_bias=True, clip_qkv_key="clip_qkv",
)
DEEPSEEK_V3 = Architecture(
    name="DeepseekV3ForCausalLM", num_experts_key="n_routed_experts", expert_intermediate_key="moe_intermediate_size",
    shared_size=_shared_sized("moe_intermediate_size", "n_shared_experts"), norm_topk_default=True,
    norm_topk_fixed=None, qkv_bias_default=False, moe_prefixes=("mlp",), expert_names=("gate_proj", "up_proj", "down_proj"),
    layer_kinds=_deepseek_layers, attention="mla", bias_key="attention_bias", o_bias=True, router="sigmoid-grouped",
    select_bias_name="e_score_correction_bias", shared_names=("shared_experts", None),
    num_experts_aliases=("num_local_experts",),
)
DEEPSEEK_V2 = dataclasses.replace(DEEPSEEK_V3, name="DeepseekV2ForCausalLM", norm_topk_default=False,
                                  router="softmax-grouped", select_bias_name=None)
GLM4_MOE = dataclasses.replace(DEEPSEEK_V3, name="Glm4MoeForCausalLM", attention="gqa", o_bias=False,
                               qk_norm_key="use_qk_norm")  # GLM-4.5: V3's MoE parts, GQA with partial rotary
GPT_OSS = Architecture(
    name="GptOssForCausalLM", num_experts_key="num_local_experts", expert_intermediate_key="intermediate_size",
    shared_size=None, norm_topk_default=True, norm_topk_fixed=True, qkv_bias_default=True, moe_prefixes=("mlp",),
    expert_names=("gate_proj", "up_proj", "down_proj"), layer_kinds=_qwen2_moe_layers, bias_key="attention_bias",
    o_bias=True, router_module="router", router_logit_bias=True, experts="clamped-swiglu", expert_layout="gpt-oss",
    sinks=True,
)  # router: top-k of the logits, softmax over the chosen = softmax, top-k, renormalised
ARCHITECTURES = {a.name: a for a in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_V3, DEEPSEEK_V2, GLM4_MOE, GPT_OSS)}
