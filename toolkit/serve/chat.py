"""Chat templates: the model's own, rendered as transformers renders them.

Where a template comes from, first found: ``chat_template.jinja`` in the model folder (or bundle),
``chat_template`` in its ``tokenizer_config.json`` (a string, or a list of named templates: "default"), a GGUF
file's ``tokenizer.chat_template``. Rendered in jinja2's immutable sandbox with the globals and filters transformers
gives (``raise_exception``, ``strftime_now``, ``tojson``; ``trim_blocks``, ``lstrip_blocks``, the loop-control
extension) and the variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` (and the other
special tokens the config names). The rendered text is tokenized without adding a BOS: the template writes its own.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..errors import ModelError

ROLES = ("system", "user", "assistant", "developer", "tool")


class TemplateError(ModelError):
    """A template that raised (``raise_exception``) or failed to render: the request's fault or the template's."""


class ChatTemplate:
    def __init__(self, source: str, specials: dict, where: str):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(f"the chat template refused the messages: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ModelError(f"{where}: the chat template does not parse ({e})") from None
        self.source, self.specials, self.where = source, specials, where

    def render(self, messages: list, add_generation_prompt: bool = True, **extra) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.specials, **extra)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise TemplateError(f"the chat template ({self.where}) failed on these messages: "
                                f"{type(e).__name__}: {e}") from None


def _token_text(v) -> str | None:
    if isinstance(v, dict):  # transformers' AddedToken form: {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def load_chat_template(model_path: str | Path) -> ChatTemplate | None:
    """The model's chat template, or None when it has none (a chat request is then refused)."""
    from ..gguf.read import is_gguf

    path = Path(model_path)
    if path.is_file():  # a GGUF file (or nothing a template could come from)
        return _gguf_template(path) if is_gguf(path) else None
    specials: dict = {}
    cfg: dict = {}
    if (path / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelError(f"{path / 'tokenizer_config.json'}: cannot read it ({e})") from None
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(cfg.get(key))
            if text is not None:
                specials[key] = text
    if (path / "chat_template.jinja").is_file():
        return ChatTemplate((path / "chat_template.jinja").read_text(encoding="utf-8"), specials,
                            str(path / "chat_template.jinja"))
    t = cfg.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if isinstance(t, str) and t.strip():
        return ChatTemplate(t, specials, str(path / "tokenizer_config.json"))
    return None


def _gguf_template(path: Path) -> ChatTemplate | None:
    import gguf

    from ..gguf.tokenizer import field_value

    reader = gguf.GGUFReader(str(path))
    t = field_value(reader, "tokenizer.chat_template", str(path))
    if not isinstance(t, str) or not t.strip():
        return None
    tokens = field_value(reader, "tokenizer.ggml.tokens", str(path)) or []
    specials = {}
    for key, field in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")):
        i = field_value(reader, field, str(path))
        if isinstance(i, int) and 0 <= i < len(tokens):
            specials[key] = tokens[i]
    return ChatTemplate(t, specials, str(path))
