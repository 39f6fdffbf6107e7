"""Qwen3-MoE: GQA with an RMSNorm over each head's q and k; llama.cpp always renormalises its top-k (as Qwen3-MoE
ships); transformers 5 writes num_experts as num_local_experts."""
from .family import Family
from .parts.attention import GQA
from .parts.experts import SwiGLU
from .parts.layers import SparseStep
from .parts.router import Softmax

FAMILY = Family(
    name="Qwen3MoeForCausalLM", gguf="qwen3moe",
    attention=GQA(qk_norm="head", bias_key="attention_bias", o_bias=True),
    router=Softmax(gguf_norm=True),
    experts=SwiGLU(count_aliases=("num_local_experts",)),
    layers=SparseStep(),
)
