"""Qwen2-MoE: GQA with q/k/v biases, softmax top-k (not renormalised unless the config says), a shared expert with
a sigmoid gate, dense MLP layers by mlp_only_layers / decoder_sparse_step."""
from .family import Family
from .parts.attention import GQA
from .parts.experts import Shared, SwiGLU
from .parts.layers import SparseStep
from .parts.router import Softmax

FAMILY = Family(
    name="Qwen2MoeForCausalLM", gguf="qwen2moe",
    attention=GQA(bias_default=True, gguf_biases=True),
    router=Softmax(),
    experts=SwiGLU(shared=Shared()),
    layers=SparseStep(),
)
