"""gpt-oss: GQA with q/k/v/o biases and one attention sink per head, sliding and full layers alternating (yarn rope);
a router with a logit bias (top-k of the logits then softmax = softmax, top-k, renormalised); the clamped SwiGLU
experts with biases. GGUF: the FFN norm named post_attention_norm, llama.cpp's sliding pattern of 2."""
from .family import Family
from .parts.attention import GQA
from .parts.experts import ClampedSwiGLU
from .parts.layers import SparseStep
from .parts.rope import Rope
from .parts.router import Softmax

FAMILY = Family(
    name="GptOssForCausalLM", gguf="gpt-oss",
    attention=GQA(bias_key="attention_bias", bias_default=True, o_bias=True, sinks=True, gguf_biases=True),
    router=Softmax(norm_fixed=True, module="router", logit_bias=True, gguf_norm=True),
    experts=ClampedSwiGLU(),
    layers=SparseStep(gguf_ffn_norm="blk.{i}.post_attention_norm.weight", gguf_swa_pattern=2),
    rope=Rope(gguf_yarn="plain"),
)
