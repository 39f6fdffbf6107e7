"""The tokenizer of a model directory (``tokenizer.json`` through the ``tokenizers`` library)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import ModelError


class Tokenizer:
    def __init__(self, directory: str | Path, bos_token_id: int | None = None, eos_token_ids: tuple = ()):
        path = Path(directory) / "tokenizer.json"
        if not path.exists():
            raise ModelError(f"{Path(directory)}: no tokenizer.json")
        try:
            self.tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exceptions on malformed files
            raise ModelError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = Path(directory) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.add_bos = bool(cfg.get("add_bos_token", bos_token_id is not None))
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)
