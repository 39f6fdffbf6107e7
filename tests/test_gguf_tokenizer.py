"""GGUF tokenizer metadata (toolkit/gguf/tokenizer.py): the bundled tokenizer.json written as llama.cpp's
converter writes it, read back into a ``tokenizers.Tokenizer`` that encodes data/heldout.txt to the same ids;
the metadata equals what the converter's own code (``gguf.SpecialVocab``) and an independent reading of
tokenizer.json give; bad tokenizers and bad files raise ModelError naming the key."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from tokenizers import Tokenizer

from toolkit.errors import ModelError
from toolkit.gguf.tokenizer import (
    field_value,
    metadata_from_tokenizer_json,
    tokenizer_from_gguf,
    write_metadata,
)

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_JSON = ROOT / "data" / "model" / "tokenizer.json"
HELDOUT = ROOT / "data" / "heldout.txt"
K = gguf.Keys.Tokenizer


def _write_gguf(path: Path, add) -> Path:
    """A minimal GGUF file: the architecture key, whatever ``add(writer)`` adds, one 1-element tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add(writer)
    writer.add_tensor("x", np.zeros(1, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_raw(path: Path, fields: dict) -> Path:
    """Fields written by Python type (str, bool, int -> uint32, list -> array), bypassing write_metadata."""
    def add(writer):
        for key, value in fields.items():
            if isinstance(value, str):
                writer.add_string(key, value)
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, int):
                writer.add_uint32(key, value)
            else:
                writer.add_array(key, value)
    return _write_gguf(path, add)


@pytest.fixture(scope="module")
def tj() -> dict:
    return json.loads(TOKENIZER_JSON.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def hf() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_JSON))


@pytest.fixture(scope="module")
def meta() -> dict:
    return metadata_from_tokenizer_json(TOKENIZER_JSON, 1, 2, True)


@pytest.fixture(scope="module")
def written(meta, tmp_path_factory) -> Path:
    return _write_gguf(tmp_path_factory.mktemp("gguf_tok") / "tok.gguf", lambda w: write_metadata(w, meta))


@pytest.fixture(scope="module")
def rebuilt(written):
    return tokenizer_from_gguf(gguf.GGUFReader(written))


# --- round trip ------------------------------------------------------------------------------------------------


def test_round_trip_encodes_heldout_like_hf(rebuilt, hf):
    text = HELDOUT.read_text(encoding="utf-8")
    ids = rebuilt[0].encode(text, add_special_tokens=False).ids
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert rebuilt[0].decode(ids) == text


@pytest.mark.parametrize("text", ["<s>", "</s>", "<unk>", "<s>Elinor</s>", " two  spaces\n\nand tabs\t"])
def test_round_trip_special_tokens_keep_ids(rebuilt, hf, text):
    assert rebuilt[0].encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("token,tid", [("<unk>", 0), ("<s>", 1), ("</s>", 2)])
def test_round_trip_token_ids(rebuilt, token, tid):
    assert rebuilt[0].token_to_id(token) == tid


def test_round_trip_ids_and_add_bos(rebuilt, hf):
    assert rebuilt[1] == {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "add_bos": True}
    # add_bos puts BOS in front when special tokens are added, as tokenizer.json's template does
    assert rebuilt[0].encode("Marianne").ids == hf.encode("Marianne").ids
    assert rebuilt[0].encode("Marianne").ids[0] == 1


def test_written_field_types_are_the_converters(written):
    """tokens/merges string arrays, token types int32, ids uint32, add_bos bool (GGUFWriter's typed methods)."""
    fields = gguf.GGUFReader(written).fields
    T = gguf.GGUFValueType
    expected = {K.MODEL: [T.STRING], K.PRE: [T.STRING], K.LIST: [T.ARRAY, T.STRING],
                K.TOKEN_TYPE: [T.ARRAY, T.INT32], K.MERGES: [T.ARRAY, T.STRING], K.BOS_ID: [T.UINT32],
                K.EOS_ID: [T.UINT32], K.UNK_ID: [T.UINT32], K.ADD_BOS: [T.BOOL]}
    assert {k: list(fields[k].types) for k in expected} == expected


@pytest.mark.parametrize("key,value", [(K.MODEL, "gpt2"), (K.BOS_ID, 1), (K.ADD_BOS, True)])
def test_field_value_scalars(written, key, value):
    got = field_value(gguf.GGUFReader(written), key)
    assert got == value and type(got) is type(value)


def test_field_value_arrays_and_absent(written, meta):
    reader = gguf.GGUFReader(written)
    assert field_value(reader, K.LIST) == meta[K.LIST]
    assert field_value(reader, K.TOKEN_TYPE) == meta[K.TOKEN_TYPE]
    assert field_value(reader, "tokenizer.ggml.no_such_key") is None


# --- the converter's values ------------------------------------------------------------------------------------


def _expected_tokens(tj: dict) -> tuple[list[str], list[int]]:
    """Independently of the module: model vocab inverted (NORMAL), added tokens by content (CONTROL if special)."""
    by_id = {i: (t, 1) for t, i in tj["model"]["vocab"].items()}
    by_id.update({a["id"]: (a["content"], 3 if a["special"] else 4) for a in tj["added_tokens"]})
    assert sorted(by_id) == list(range(len(by_id)))  # the bundled tokenizer has no gaps
    return [by_id[i][0] for i in range(len(by_id))], [by_id[i][1] for i in range(len(by_id))]


@pytest.mark.parametrize("key", [K.MODEL, K.PRE, K.LIST, K.TOKEN_TYPE, K.MERGES])
def test_metadata_matches_tokenizer_json(meta, tj, key):
    tokens, types = _expected_tokens(tj)
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in tj["model"]["merges"]]
    expected = {K.MODEL: "gpt2", K.PRE: "gpt-2", K.LIST: tokens, K.TOKEN_TYPE: types, K.MERGES: merges}
    assert meta[key] == expected[key]


def test_metadata_matches_converters_special_vocab(meta):
    """gguf.SpecialVocab is the converter's own reader of merges, special ids and add_bos."""
    sv = gguf.SpecialVocab(TOKENIZER_JSON.parent, load_merges=True)
    assert meta[K.MERGES] == sv.merges
    assert (meta[K.BOS_ID], meta[K.EOS_ID], meta[K.UNK_ID]) == (sv.special_token_ids["bos"],
                                                                 sv.special_token_ids["eos"],
                                                                 sv.special_token_ids["unk"])
    assert meta[K.ADD_BOS] is sv.add_special_token["bos"]


def test_metadata_without_bos_eos_leaves_keys_out():
    meta = metadata_from_tokenizer_json(TOKENIZER_JSON, None, None, False)
    assert K.BOS_ID not in meta and K.EOS_ID not in meta and meta[K.ADD_BOS] is False


def test_vocab_size_pads_with_unused(tj):
    meta = metadata_from_tokenizer_json(tj, 1, 2, True, vocab_size=8195)
    assert meta[K.LIST][-3:] == ["[PAD8192]", "[PAD8193]", "[PAD8194]"]
    assert meta[K.TOKEN_TYPE][-3:] == [5, 5, 5]
    with pytest.raises(ModelError, match="vocab_size 100"):
        metadata_from_tokenizer_json(tj, 1, 2, True, vocab_size=100)


@pytest.mark.parametrize("pad_to, length", [(8195, 8195), (8192, 8192), (64, 8192)])
def test_pad_to_pads_and_never_cuts(tj, pad_to, length):
    """The export's rule: a token per embedding row at least; a tokenizer with more ids than rows (a small test
    model over the bundled tokenizer) keeps its whole list."""
    meta = metadata_from_tokenizer_json(tj, 1, 2, True, pad_to=pad_to)
    assert len(meta[K.LIST]) == length and meta[K.LIST][:3] == metadata_from_tokenizer_json(tj, 1, 2, True)[K.LIST][:3]


# content, special flag in tokenizer.json -> GGUF token type (the converter's does_token_look_special included)
ADDED = [("<tool>", True, 3), ("<tool>", False, 4), ("<|im_end|>", False, 3), ("<pad>", False, 3),
         (" hello world", False, 4)]


@pytest.mark.parametrize("content,special,ttype", ADDED)
def test_added_tokens_typed_and_round_tripped(tj, tmp_path, content, special, ttype):
    t = copy.deepcopy(tj)
    t["added_tokens"].append({"id": 8192, "content": content, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": special})
    meta = metadata_from_tokenizer_json(t, 1, 2, True)
    assert (meta[K.LIST][8192], meta[K.TOKEN_TYPE][8192]) == (content, ttype)
    tok, _ = tokenizer_from_gguf(gguf.GGUFReader(_write_gguf(tmp_path / "t.gguf", lambda w: write_metadata(w, meta))))
    text = f"Elinor said{content}to Marianne"
    assert tok.encode(text, add_special_tokens=False).ids == \
        Tokenizer.from_str(json.dumps(t)).encode(text, add_special_tokens=False).ids


# --- bad input -------------------------------------------------------------------------------------------------


def _set(path: str, value):
    def mutate(t):
        *outer, last = path.split(".")
        d = t
        for p in outer:
            d = d[p]
        if value is _DROP:
            del d[last]
        else:
            d[last] = value
    return mutate


_DROP = object()
BAD_JSON = [
    ("wordpiece", _set("model.type", "WordPiece"), "model type 'WordPiece'"),
    ("unigram", _set("model.type", "Unigram"), "model type 'Unigram'"),
    ("metaspace", _set("pre_tokenizer", {"type": "Metaspace", "replacement": "▁"}), "pre-tokenizer 'Metaspace'"),
    ("prefix_space", _set("pre_tokenizer.add_prefix_space", True), "pre-tokenizer 'ByteLevel'"),
    ("split_sequence", _set("pre_tokenizer", {"type": "Sequence", "pretokenizers": [
        {"type": "Split"}, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}),
     r"pre-tokenizer Sequence\[Split, ByteLevel\]"),
    ("normalizer", _set("normalizer", {"type": "NFC"}), "normalizer 'NFC'"),
    ("byte_fallback", _set("model.byte_fallback", True), "byte_fallback"),
    ("no_merges", _set("model.merges", _DROP), "merges"),
]


@pytest.mark.parametrize("mutate,match", [b[1:] for b in BAD_JSON], ids=[b[0] for b in BAD_JSON])
def test_unsupported_tokenizer_json(tj, mutate, match):
    t = copy.deepcopy(tj)
    mutate(t)
    with pytest.raises(ModelError, match=match) as e:
        metadata_from_tokenizer_json(t, 1, 2, True)
    assert "supported" in str(e.value) or match == "merges"


# a small valid tokenizer.ggml.* set; each bad case overrides one key (None drops it)
SMALL = {K.MODEL: "gpt2", K.PRE: "gpt-2", K.LIST: ["<s>", "</s>", "a", "b", "ab"], K.TOKEN_TYPE: [3, 3, 1, 1, 1],
         K.MERGES: ["a b"], K.BOS_ID: 0, K.EOS_ID: 1, K.ADD_BOS: True}
BAD_GGUF = [
    ("model_llama", {K.MODEL: "llama"}, K.MODEL, "'llama'"),
    ("model_missing", {K.MODEL: None}, K.MODEL, "None"),
    ("pre_llama3", {K.PRE: "llama-bpe"}, K.PRE, "'llama-bpe'"),
    ("pre_default", {K.PRE: "default"}, K.PRE, "'default'"),
    ("pre_roberta", {K.PRE: "roberta-bpe"}, K.PRE, "'roberta-bpe'"),
    ("tokens_missing", {K.LIST: None}, K.LIST, "missing"),
    ("tokens_ints", {K.LIST: [1, 2, 3, 4, 5]}, K.LIST, "strings"),
    ("token_type_short", {K.TOKEN_TYPE: [3, 3, 1]}, K.TOKEN_TYPE, "3 entries"),
    ("merges_missing", {K.MERGES: None}, K.MERGES, "missing"),
    ("merge_no_space", {K.MERGES: ["ab"]}, K.MERGES, "'ab'"),
    ("merge_unknown_side", {K.MERGES: ["a c"]}, K.MERGES, "'c'"),
    ("merge_unknown_result", {K.MERGES: ["b a"]}, K.MERGES, "'ba'"),
    ("bos_out_of_range", {K.BOS_ID: 99}, K.BOS_ID, "99"),
]


@pytest.mark.parametrize("override,key,detail", [b[1:] for b in BAD_GGUF], ids=[b[0] for b in BAD_GGUF])
def test_bad_gguf_names_file_and_key(tmp_path, override, key, detail):
    fields = {k: v for k, v in {**SMALL, **override}.items() if v is not None}
    path = _write_raw(tmp_path / "bad.gguf", fields)
    with pytest.raises(ModelError) as e:
        tokenizer_from_gguf(gguf.GGUFReader(path))
    msg = str(e.value)
    assert key in msg and detail in msg and str(path) in msg


def test_small_gguf_is_valid(tmp_path):
    """The base of the bad-input table works, so each bad case fails for its own key."""
    tok, meta = tokenizer_from_gguf(gguf.GGUFReader(_write_raw(tmp_path / "ok.gguf", SMALL)))
    assert tok.encode("ab", add_special_tokens=False).ids == [4]
    assert tok.encode("ab").ids == [0, 4]
    assert meta == {"bos_token_id": 0, "eos_token_id": 1, "unk_token_id": None, "add_bos": True}
