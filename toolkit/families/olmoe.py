"""OLMoE: GQA with an RMSNorm over the whole q and k projections and an optional clip of q, k, v; top-k not
renormalised."""
from .family import Family
from .parts.attention import GQA
from .parts.experts import SwiGLU
from .parts.router import Softmax

FAMILY = Family(
    name="OlmoeForCausalLM", gguf="olmoe",
    attention=GQA(qk_norm="proj", bias_key="attention_bias", o_bias=True, clip_key="clip_qkv"),
    router=Softmax(),
    experts=SwiGLU(size_key="intermediate_size", gguf_ff=False),
)
