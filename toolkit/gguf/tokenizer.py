"""A byte-level BPE tokenizer as GGUF metadata (``tokenizer.ggml.*``) and back.

Writing follows llama.cpp's converter: ``convert_hf_to_gguf.py`` (``get_vocab_base``, ``_set_vocab_gpt2``) and
``gguf-py/gguf/vocab.py`` (``SpecialVocab``, merges and special ids). Reading follows llama.cpp's loader,
``src/llama-vocab.cpp``: model ``gpt2`` is BPE over GPT-2's byte-to-unicode alphabet, merges are "a b" strings
(split at the first space after the first character), and ``tokenizer.ggml.pre`` picks the pre-tokenizer regex.

- ``metadata_from_tokenizer_json(path_or_dict, bos, eos, add_bos)``: a Hugging Face ``tokenizer.json`` (BPE model,
  ByteLevel pre-tokenizer) -> {GGUF key: value}.
- ``write_metadata(writer, meta)``: those keys into a ``gguf.GGUFWriter`` with its typed methods.
- ``tokenizer_from_gguf(reader)``: a ``gguf.GGUFReader``'s ``tokenizer.ggml.*`` fields -> (``tokenizers.Tokenizer``,
  {"bos_token_id", "eos_token_id", "add_bos", "unk_token_id"}).

Where we differ from the converter: it detects ``tokenizer.ggml.pre`` by hashing the ids of a probe text and
knows only published vocabularies (a tokenizer trained here matches no hash, and it stops); we read the structure
of ``tokenizer.json`` instead, and a plain ByteLevel pre-tokenizer is GPT-2's regex, i.e. pre "gpt-2". It also
rewrites "▁" to " " in user-defined added tokens (a SentencePiece fix for Gemma); a byte-level BPE has no "▁"
convention, so we keep added tokens as written.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelError

# GGUF keys (gguf.constants.Keys.Tokenizer spells the same strings; kept here so that writing a dict needs no gguf)
MODEL = "tokenizer.ggml.model"
PRE = "tokenizer.ggml.pre"
TOKENS = "tokenizer.ggml.tokens"
TOKEN_TYPE = "tokenizer.ggml.token_type"
MERGES = "tokenizer.ggml.merges"
BOS_ID = "tokenizer.ggml.bos_token_id"
EOS_ID = "tokenizer.ggml.eos_token_id"
UNK_ID = "tokenizer.ggml.unknown_token_id"
ADD_BOS = "tokenizer.ggml.add_bos_token"

# gguf.TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_MODEL = "gpt2"
GPT2_PRE = "gpt-2"
# tokenizer.ggml.pre values that llama-vocab.cpp maps to exactly GPT-2's regex
# ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)) with no other effect on encoding.
# Not here: "default" (GPT-2's regex plus splits of punctuation runs and of digits into threes), and
# "roberta-bpe" / "jina-v1-en" / "jina-v2-code" (GPT-2's regex, but they also append a SEP token).
GPT2_REGEX_PRES = frozenset({
    "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
    "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling",
})


# ---------------------------------------------------------------------------------------------------------------
# tokenizer.json -> GGUF metadata


def metadata_from_tokenizer_json(path_or_dict, bos_token_id: int | None, eos_token_id: int | None,
                                 add_bos: bool, *, vocab_size: int | None = None,
                                 pad_to: int | None = None) -> dict[str, object]:
    """The ``tokenizer.ggml.*`` key/values llama.cpp's converter writes for a byte-level BPE ``tokenizer.json``
    (a path or the parsed dict). ``vocab_size`` (the model's embedding rows) pads the token list with UNUSED
    "[PAD{i}]" tokens as the converter does, and refuses a tokenizer with more ids; ``pad_to`` only pads (a
    list longer than it is kept whole); by default the list ends at the highest id. A None bos/eos id leaves its
    key out."""
    tj, where = _load_tokenizer_json(path_or_dict)
    _check_byte_level_bpe(tj, where)
    tokens, types = _token_list(tj, where, vocab_size, pad_to)  # [V] str, [V] int
    meta: dict[str, object] = {MODEL: GPT2_MODEL, PRE: GPT2_PRE, TOKENS: tokens, TOKEN_TYPE: types,
                               MERGES: _merge_strings(tj["model"].get("merges"), where)}
    for key, tid in ((BOS_ID, bos_token_id), (EOS_ID, eos_token_id), (UNK_ID, _unk_id(tj, where))):
        if tid is not None:
            if not 0 <= int(tid) < len(tokens):
                raise ModelError(f"{where}: {key} = {tid} is outside the vocabulary of {len(tokens)} tokens")
            meta[key] = int(tid)
    meta[ADD_BOS] = bool(add_bos)
    return meta


def _load_tokenizer_json(path_or_dict) -> tuple[dict, str]:
    """-> (parsed tokenizer.json, a name for error messages)."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, "tokenizer.json"
    path = Path(path_or_dict)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), str(path)
    except FileNotFoundError:
        raise ModelError(f"{path}: no such tokenizer file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: not a readable tokenizer.json ({e})") from None


def _check_byte_level_bpe(tj: dict, where: str) -> None:
    """Raise unless ``tj`` is what llama.cpp's gpt2 model with pre "gpt-2" reproduces exactly."""
    supported = ("supported: model BPE with a ByteLevel pre-tokenizer (use_regex true, add_prefix_space false), "
                 "no normalizer, a ByteLevel decoder or none")
    model = tj.get("model") or {}
    mtype = model.get("type", "BPE" if "merges" in model else None)
    if mtype != "BPE":
        raise ModelError(f"{where}: tokenizer model type {mtype!r} is not supported for GGUF; {supported}")
    for opt, plain in (("dropout", None), ("byte_fallback", False), ("continuing_subword_prefix", None),
                       ("end_of_word_suffix", None), ("ignore_merges", False)):
        if model.get(opt, plain) not in (plain, ""):
            raise ModelError(f"{where}: BPE option {opt} = {model[opt]!r} has no GGUF equivalent; {supported}")
    pre = _single(tj.get("pre_tokenizer"))
    if not (pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", True)):
        raise ModelError(f"{where}: pre-tokenizer {_describe(tj.get('pre_tokenizer'))} is not supported for "
                         f"GGUF; {supported}")
    if tj.get("normalizer") is not None:
        raise ModelError(f"{where}: normalizer {_describe(tj['normalizer'])} is not supported for GGUF; "
                         f"{supported}")
    dec = tj.get("decoder")
    if dec is not None and _single(dec).get("type") != "ByteLevel":
        raise ModelError(f"{where}: decoder {_describe(dec)} is not supported for GGUF; {supported}")


def _single(component: dict | None) -> dict | None:
    """A Sequence of one component -> that component (anything else unchanged)."""
    if component and component.get("type") == "Sequence":
        parts = component.get("pretokenizers") or component.get("decoders") or []
        return parts[0] if len(parts) == 1 else component
    return component


def _describe(component: dict | None) -> str:
    if component is None:
        return "none"
    if component.get("type") == "Sequence":
        parts = component.get("pretokenizers") or component.get("decoders") or component.get("normalizers") or []
        return "Sequence[" + ", ".join(str(p.get("type")) for p in parts) + "]"
    opts = {k: v for k, v in component.items() if k in ("add_prefix_space", "use_regex")}
    return f"{component.get('type')!r}" + (f" {opts}" if opts else "")


def _token_list(tj: dict, where: str, vocab_size: int | None, pad_to: int | None = None) -> tuple[list[str], list[int]]:
    """-> (tokens [V] in id order, token types [V]) as ``get_vocab_base`` builds them: added tokens by their
    content (CONTROL if special or looking special, else USER_DEFINED), model tokens NORMAL, gaps UNUSED."""
    by_id: dict[int, tuple[str, int]] = {int(i): (tok, NORMAL) for tok, i in tj["model"].get("vocab", {}).items()}
    for at in tj.get("added_tokens", []):
        content = at["content"]
        by_id[int(at["id"])] = (content, CONTROL if at.get("special") or _looks_special(content) else USER_DEFINED)
    if not by_id:
        raise ModelError(f"{where}: the tokenizer has an empty vocabulary")
    n = max(by_id) + 1
    if vocab_size is not None:
        if vocab_size < n:
            raise ModelError(f"{where}: vocab_size {vocab_size} is smaller than the tokenizer's {n} token ids")
        n = vocab_size
    if pad_to is not None:
        n = max(n, pad_to)
    pairs = [by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(n)]
    return [t for t, _ in pairs], [k for _, k in pairs]


def _looks_special(text: str) -> bool:
    """The converter's ``does_token_look_special``: added tokens some models forgot to mark special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _merge_strings(merges, where: str) -> list[str]:
    """tokenizer.json merges (old "a b" strings or new ["a", "b"] pairs) -> [M] "a b" strings. A space inside a
    part is written as U+0120 ("Ġ", byte-level's space), as SpecialVocab does."""
    if not isinstance(merges, list) or not merges:
        raise ModelError(f"{where}: model.merges is missing or empty; a BPE tokenizer needs its merges")
    if all(isinstance(m, str) for m in merges):
        return list(merges)
    if all(isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) for s in m) for m in merges):
        return [" ".join(s.replace(" ", "\u0120") for s in m) for m in merges]
    raise ModelError(f"{where}: model.merges is neither a list of 'a b' strings nor of [a, b] pairs")


def _unk_id(tj: dict, where: str) -> int | None:
    unk = tj["model"].get("unk_token")
    if unk is None:
        return None
    for at in tj.get("added_tokens", []):
        if at["content"] == unk:
            return int(at["id"])
    if unk in tj["model"].get("vocab", {}):
        return int(tj["model"]["vocab"][unk])
    raise ModelError(f"{where}: unk_token {unk!r} is neither in the vocabulary nor among the added tokens")


# ---------------------------------------------------------------------------------------------------------------
# GGUF metadata -> a GGUFWriter


def write_metadata(writer, meta: dict) -> None:
    """Add ``meta`` (from ``metadata_from_tokenizer_json``) to a ``gguf.GGUFWriter`` with its typed methods
    (tokens and merges as string arrays, token types as int32, ids as uint32, add_bos as bool)."""
    writer.add_tokenizer_model(meta[MODEL])
    writer.add_tokenizer_pre(meta[PRE])
    writer.add_token_list(meta[TOKENS])
    writer.add_token_types(meta[TOKEN_TYPE])
    writer.add_token_merges(meta[MERGES])
    for key, add in ((BOS_ID, writer.add_bos_token_id), (EOS_ID, writer.add_eos_token_id),
                     (UNK_ID, writer.add_unk_token_id)):
        if meta.get(key) is not None:
            add(meta[key])
    if ADD_BOS in meta:
        writer.add_add_bos_token(bool(meta[ADD_BOS]))


# ---------------------------------------------------------------------------------------------------------------
# GGUFReader -> tokenizers.Tokenizer


def field_value(reader, key: str, where: str = "GGUF"):
    """A GGUF field as Python: str / int / float / bool, or a list of them for an array; None when absent.
    (``reader.fields[key]``: ``types`` [ARRAY, item type] or [type]; ``data`` indexes ``parts`` for values.)"""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return None
    vtype = field.types[-1] if field.types else None
    values = [_part_value(field.parts[i], vtype, key, where) for i in field.data]
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
        return values
    if len(values) != 1:
        raise ModelError(f"{where}: {key} holds {len(values)} values where one was expected")
    return values[0]


def _part_value(part, vtype, key: str, where: str):
    import gguf

    if vtype == gguf.GGUFValueType.STRING:
        try:
            return bytes(part).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"{where}: {key} holds a string that is not UTF-8") from None
    value = part[0].item()
    return bool(value) if vtype == gguf.GGUFValueType.BOOL else value


def tokenizer_from_gguf(reader):
    """A ``gguf.GGUFReader``'s ``tokenizer.ggml.*`` fields -> (``tokenizers.Tokenizer``, {"bos_token_id",
    "eos_token_id", "unk_token_id": int | None, "add_bos": bool}). The tokenizer encodes as llama.cpp does
    for model "gpt2" with a GPT-2-regex pre-tokenizer; with add_bos it also prepends BOS when asked to add
    special tokens."""
    where = _reader_name(reader)
    _check_gguf_kind(reader, where)
    tokens, types = _gguf_tokens(reader, where)
    merges = _gguf_merges(reader, where)
    meta = {"bos_token_id": _gguf_id(reader, BOS_ID, len(tokens), where),
            "eos_token_id": _gguf_id(reader, EOS_ID, len(tokens), where),
            "unk_token_id": _gguf_id(reader, UNK_ID, len(tokens), where),
            "add_bos": _gguf_bool(reader, ADD_BOS, where)}
    tok = _build_tokenizer(tokens, types, merges, meta, where)
    return tok, meta


def _reader_name(reader) -> str:
    name = getattr(getattr(reader, "data", None), "filename", None)
    return str(name) if name else "GGUF file"


def _check_gguf_kind(reader, where: str) -> None:
    model = field_value(reader, MODEL, where)
    if model != GPT2_MODEL:
        raise ModelError(f"{where}: {MODEL} = {model!r} is not supported; supported: {GPT2_MODEL!r} "
                         f"(byte-level BPE)")
    pre = field_value(reader, PRE, where)
    if pre not in GPT2_REGEX_PRES:
        raise ModelError(f"{where}: {PRE} = {pre!r} is not supported; supported: the pre-tokenizers llama.cpp "
                         f"runs as GPT-2's regex: {', '.join(sorted(GPT2_REGEX_PRES))}")


def _gguf_tokens(reader, where: str) -> tuple[list[str], list[int]]:
    """-> (tokens [V], token types [V]); types default to NORMAL when the file has none."""
    tokens = field_value(reader, TOKENS, where)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelError(f"{where}: {TOKENS} is missing or not a non-empty list of strings")
    if len(set(tokens)) != len(tokens):
        raise ModelError(f"{where}: {TOKENS} holds the same token text twice; ids would be ambiguous")
    types = field_value(reader, TOKEN_TYPE, where)
    if types is None:
        return tokens, [NORMAL] * len(tokens)
    if not isinstance(types, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise ModelError(f"{where}: {TOKEN_TYPE} is not a list of integers")
    if len(types) != len(tokens):
        raise ModelError(f"{where}: {TOKEN_TYPE} has {len(types)} entries but {TOKENS} has {len(tokens)}")
    return tokens, types


def _gguf_merges(reader, where: str) -> list[tuple[str, str]]:
    """-> [M] (left, right), split as llama-vocab.cpp does: at the first space after the first character."""
    merges = field_value(reader, MERGES, where)
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ModelError(f"{where}: {MERGES} is missing or not a list of strings (a gpt2 tokenizer needs them)")
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)
        if cut < 0:
            raise ModelError(f"{where}: {MERGES} entry {m!r} is not 'left right'")
        pairs.append((m[:cut], m[cut + 1:]))
    return pairs


def _gguf_id(reader, key: str, n_tokens: int, where: str) -> int | None:
    tid = field_value(reader, key, where)
    if tid is None:
        return None
    if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < n_tokens:
        raise ModelError(f"{where}: {key} = {tid!r} is not a token id below {n_tokens}")
    return tid


def _gguf_bool(reader, key: str, where: str) -> bool:
    value = field_value(reader, key, where)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ModelError(f"{where}: {key} = {value!r} is not a bool")
    return value


def _build_tokenizer(tokens: list[str], types: list[int], merges: list[tuple[str, str]], meta: dict, where: str):
    """BPE over all tokens (ids = positions), GPT-2 ByteLevel pre-tokenizer and decoder, CONTROL and
    USER_DEFINED tokens as added tokens (CONTROL ones special), BOS template when add_bos."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    unk = tokens[meta["unk_token_id"]] if meta["unk_token_id"] is not None else None
    vocab = {t: i for i, t in enumerate(tokens)}
    _check_merges_fit(merges, vocab, where)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=(k == CONTROL), normalized=False)
             for i, k in enumerate(types) if k in (CONTROL, USER_DEFINED)]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
    if meta["add_bos"] and meta["bos_token_id"] is not None:
        bos = tokens[meta["bos_token_id"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta["bos_token_id"])])
    return tok


def _check_merges_fit(merges: list[tuple[str, str]], vocab: dict[str, int], where: str) -> None:
    """Both sides of every merge and their concatenation must be tokens: tokenizers' BPE raises a bare
    Exception for an unknown side and panics (a BaseException) for an unknown result."""
    for rank, (left, right) in enumerate(merges):
        missing = [t for t in (left, right, left + right) if t not in vocab]
        if missing:
            raise ModelError(f"{where}: {MERGES} entry {rank} ({left!r} {right!r}) names {missing[0]!r}, "
                             f"which is not in {TOKENS}")
