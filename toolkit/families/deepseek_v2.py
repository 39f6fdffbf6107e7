"""DeepSeek-V2: DeepSeek-V3's parts with a softmax router, group-limited by each group's best expert (or greedy)."""
import dataclasses

from .deepseek_v3 import FAMILY as V3
from .parts.router import SoftmaxGrouped

FAMILY = dataclasses.replace(V3, name="DeepseekV2ForCausalLM", router=SoftmaxGrouped())
