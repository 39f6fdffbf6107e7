"""Mixtral: GQA, softmax top-k always renormalised, per-expert w1/w3/w2. GGUF: llama.cpp's "llama" with experts,
q/k rows in GGML's adjacent-pair rope order."""
from .family import Family
from .parts.attention import GQA
from .parts.experts import SwiGLU
from .parts.router import Softmax

FAMILY = Family(
    name="MixtralForCausalLM", gguf="llama",
    attention=GQA(gguf_rope_pairs=True),
    router=Softmax(norm_fixed=True, gguf_norm=True),
    experts=SwiGLU(count_key="num_local_experts", size_key="intermediate_size", names=("w1", "w3", "w2"),
                   prefixes=("block_sparse_moe", "mlp"), gguf_ff=False),
)
