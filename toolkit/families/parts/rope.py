"""The rope part: which rope scalings a family's GGUF carries. The rotary frequencies themselves are one formula
for every family (``toolkit.model.config.rope_inv_freq``, from the config's rope type)."""
from __future__ import annotations

from dataclasses import dataclass

from . import Part


@dataclass(frozen=True)
class Rope(Part):
    """``gguf_yarn``: None (llama.cpp's architecture runs unscaled rope only), "plain" (yarn, with our
    ``rope.scaling.yarn_truncate`` key beside llama.cpp's: gpt-oss does not round its correction range) or
    "mscale" (DeepSeek's yarn: llama.cpp keeps 0.1 * mscale_all_dim as yarn_log_multiplier, mscale equal to it)."""

    gguf_yarn: str | None = None

    def describe(self, cfg) -> str:
        s = cfg.rope_type + (f" (scale {cfg.rope_params.get('factor')})" if cfg.rope_params.get("factor") else "")
        return s + (f", on {cfg.rotary_dim} of {cfg.head_dim} head dims" if cfg.rotary_dim else "")

    def gguf_config(self, m, raw: dict) -> None:
        if self.gguf_yarn == "mscale" and "rope_scaling" in raw:
            log_mul = m.x("rope.scaling.yarn_log_multiplier", 0, 1e5, 0.0) / 0.1
            raw["rope_scaling"] = {**raw["rope_scaling"], "mscale": log_mul, "mscale_all_dim": log_mul}

    def gguf_metadata(self, w, cfg) -> None:
        from ...gguf.names import YARN_TRUNCATE

        if cfg.rope_type == "yarn" and self.gguf_yarn == "plain":
            w.add_bool(f"{w.arch}.{YARN_TRUNCATE}", bool(cfg.rope_params.get("truncate", True)))

    def gguf_problems(self, cfg) -> list:
        p = cfg.rope_params
        yarn_ok = cfg.rope_type == "yarn" and (self.gguf_yarn == "plain" or self.gguf_yarn == "mscale" and
                                               p.get("mscale", 1.0) == p.get("mscale_all_dim", 1.0))
        return ["rope scaling"] if cfg.rope_type != "default" and not yarn_ok else []
