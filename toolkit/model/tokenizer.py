"""The tokenizer of a model directory (``tokenizer.json`` through the ``tokenizers`` library)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import ModelError
from ..files import Folder
from .schema import Keys


class Tokenizer:
    def __init__(self, directory: str | Path, bos_token_id: int | None = None, eos_token_ids: tuple = (),
                 allow_outside: bool = False):
        folder = Folder(directory, allow_outside)
        if not folder.exists("tokenizer.json"):
            raise ModelError(f"{folder.dir}: no tokenizer.json")
        path = folder.path("tokenizer.json")
        try:
            self.tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exceptions on malformed files
            raise ModelError(f"{path}: cannot load tokenizer ({str(e)[:300]})") from None
        cfg = folder.json("tokenizer_config.json") if folder.exists("tokenizer_config.json") else {}
        where = str(folder.dir / "tokenizer_config.json")
        self.add_bos = Keys(cfg, where).bool("add_bos_token", bos_token_id is not None)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)

    @classmethod
    def from_tokenizer(cls, tok: _HFTokenizer, bos_token_id: int | None, eos_token_ids: tuple = (),
                       add_bos: bool = False) -> Tokenizer:
        """A tokenizer built elsewhere (from a GGUF file's metadata: ``toolkit/gguf/tokenizer.py``)."""
        self = cls.__new__(cls)
        self.tok, self.add_bos = tok, add_bos
        self.bos_token_id, self.eos_token_ids = bos_token_id, tuple(eos_token_ids)
        return self

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        if not isinstance(text, str):
            raise ModelError(f"text to encode must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            c = ord(text[e.start])
            what = f"byte {c - 0xDC00:#04x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
            raise ModelError(f"the text is not valid UTF-8 ({what} at character {e.start})") from None
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def encode_for(self, text: str, vocab_size: int, what: str = "the text") -> list[int]:
        """``encode`` for a model of ``vocab_size`` tokens: refuses ids the model cannot embed, naming both sizes."""
        ids = self.encode(text)
        bad = [i for i in ids if i >= vocab_size]
        if bad:
            raise ModelError(f"{what} encodes to token id {max(bad)}, beyond the model's vocab_size {vocab_size} "
                             f"(tokenizer.json has {self.vocab_size} tokens: this tokenizer does not belong to this model)")
        return ids
