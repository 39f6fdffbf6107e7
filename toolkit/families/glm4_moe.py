"""GLM-4.5: DeepSeek-V3's MoE parts on GQA (q/k/v biases, optional per-head q/k norms, rope on part of each head).
GGUF: the FFN norm named post_attention_norm; block_count includes the NextN (multi-token prediction) layers, which
this runtime does not run."""
import dataclasses

from .deepseek_v3 import FAMILY as V3
from .family import Family
from .parts.attention import GQA
from .parts.experts import SharedCount


def _nextn(m, raw: dict) -> None:
    raw["num_hidden_layers"] -= m.n("nextn_predict_layers", 0, raw["num_hidden_layers"] - 1, 0)


FAMILY = Family(
    name="Glm4MoeForCausalLM", gguf="glm4moe",
    attention=GQA(bias_key="attention_bias", qk_norm_key="use_qk_norm", gguf_biases=True, gguf_partial_rotary=True),
    router=V3.router,
    experts=dataclasses.replace(V3.experts, shared=SharedCount(gguf_length=True)),
    layers=dataclasses.replace(V3.layers, gguf_ffn_norm="blk.{i}.post_attention_norm.weight"),
    gguf_rule=_nextn,
)
