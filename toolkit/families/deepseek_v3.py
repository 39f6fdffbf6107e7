"""DeepSeek-V3: MLA, sigmoid routing with a selection bias in expert groups, leading dense layers, shared experts run
as one ungated MLP. GGUF: llama.cpp's "deepseek2" (with V2), told apart by the gating function."""
from .family import Family
from .parts.attention import MLA
from .parts.experts import SharedCount, SwiGLU
from .parts.layers import LeadingDense
from .parts.rope import Rope
from .parts.router import SigmoidGrouped

FAMILY = Family(
    name="DeepseekV3ForCausalLM", gguf="deepseek2",
    attention=MLA(),
    router=SigmoidGrouped(),
    experts=SwiGLU(count_key="n_routed_experts", count_aliases=("num_local_experts",), shared=SharedCount()),
    layers=LeadingDense(),
    rope=Rope(gguf_yarn="mscale"),
)
