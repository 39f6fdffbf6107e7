"""GGUF data layout and metadata numbers checked as the safetensors reader checks its own (issue 29): a small valid
GGUF (the tiny checkpoint, q4_0 experts) damaged one way per row by rewriting its header bytes (a tensor's offset,
type or dims; a metadata value or its type tag); each is refused with one ModelError naming the file and the tensor
or key (the whole message matched), before any data is used or any arithmetic done; the CLI prints it as one line,
rc 2. The undamaged file still loads and runs as the checkpoint does."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import tiny_model  # noqa: E402
from test_uqff_support import _with_tokenizer  # noqa: E402
from toolkit.errors import ModelError  # noqa: E402
from toolkit.gguf.export import export_gguf  # noqa: E402
from toolkit.load import load_model  # noqa: E402
from toolkit.model import SamplingParams, generate_tokens  # noqa: E402
from toolkit.quant import parse_policy  # noqa: E402

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny checkpoint, its GGUF export (q4_0 experts) and where each header field lies in the file."""
    root = tmp_path_factory.mktemp("gguf_layout")
    ckpt = _with_tokenizer(tiny_model.write(root / "ckpt"))
    path = root / "m.gguf"
    export_gguf(ckpt, path, parse_policy("moqe", "q4_0"))
    r = gguf.GGUFReader(path)
    tensors = {}
    for t in r.tensors:  # a tensor-info entry: name length (u64), name, dim count (u32), dims (u64 each), type, offset
        dims = t.field.offset + 8 + len(t.name.encode()) + 4
        typ = dims + 8 * len(t.shape)
        tensors[t.name] = dict(name=t.field.offset + 8, dims=dims, type=typ, offset=typ + 4,
                               rel=int(t.data_offset) - int(r.data_offset))
    keys = {k: f.offset + 8 + len(k.encode()) for k, f in r.fields.items() if not k.startswith("GGUF.")}  # type tag
    return dict(ckpt=ckpt, path=path, raw=path.read_bytes(), tensors=tensors, keys=keys, size=path.stat().st_size,
                data=int(r.data_offset))


def _offset(name, value):
    def f(b, P):
        struct.pack_into("<Q", b, P["tensors"][name]["offset"], value(P) if callable(value) else value)
    return f


def _moved(name, onto, plus=0):  # tensor ``name``'s data offset set to tensor ``onto``'s (+ plus bytes)
    return _offset(name, lambda P: P["tensors"][onto]["rel"] + plus)


def _type(name, gtype):
    def f(b, P):
        struct.pack_into("<I", b, P["tensors"][name]["type"], int(gtype))
    return f


def _dim(name, i, value):  # GGUF dim i (innermost first)
    def f(b, P):
        struct.pack_into("<Q", b, P["tensors"][name]["dims"] + 8 * i, value)
    return f


def _renamed(name, to):  # same length: the table's layout is unchanged
    def f(b, P):
        assert len(to) == len(name)
        pos = P["tensors"][name]["name"]
        b[pos:pos + len(name)] = to.encode()
    return f


def _value(key, fmt, value, tag=None):
    """Metadata ``key``'s 4-byte value rewritten (``fmt``: struct format), its type tag too when ``tag`` is given."""
    def f(b, P):
        pos = P["keys"][key]
        if tag is not None:
            struct.pack_into("<I", b, pos, int(tag))
        struct.pack_into(fmt, b, pos + 4, value)
    return f


def _u32(key, value):
    return _value(key, "<I", value)


DOWN, UP = "blk.0.ffn_down_exps.weight", "blk.0.ffn_up_exps.weight"
HC = "llama.attention.head_count"
W = r"must be a whole number in \[{}, {}\], got {}"
ROWS = [  # id, damage, message after "FILE: " (a regex matched against the whole message)
    ("offset-onto-another", _moved(DOWN, UP),
     r"tensor 'blk.0.ffn_down_exps.weight' \(bytes (\d+)\.\.(\d+)\) overlaps tensor 'blk.0.ffn_up_exps.weight' "
     r"\(bytes \1\.\.\2\)"),
    ("offset-inside-another", _moved("blk.0.attn_q.weight", "token_embd.weight", 1024),
     r"tensor 'token_embd.weight' of type F32 and shape \[64, 64\] needs 16384 bytes \(bytes \d+\.\.\d+\), but tensor "
     r"'blk.0.attn_q.weight' begins at byte \d+: the two overlap"),
    ("wider-type-q4_0-as-q8_0", _type(DOWN, T.Q8_0),
     r"tensor 'blk.0.ffn_down_exps.weight' of type Q8_0 and shape \[4, 64, 64\] needs 17408 bytes \(bytes \d+\.\.\d+\), "
     r"but tensor 'blk.1.attn_norm.weight' begins at byte \d+: the two overlap"),
    ("wider-type-f32-as-f64-last", _type("output.weight", T.F64),
     r"tensor 'output.weight' of type F64 and shape \[64, 64\] needs 32768 bytes from byte \d+, but the file holds "
     r"\d+ bytes from there \(it ends at byte \d+\)"),
    ("wider-type-q4_0-as-f32", _type(UP, T.F32),
     r"tensor 'blk.0.ffn_up_exps.weight' of type F32 and shape \[4, 64, 64\] needs 65536 bytes \(bytes \d+\.\.\d+\), "
     r"but tensor 'blk.0.ffn_down_exps.weight' begins at byte \d+: the two overlap"),
    ("type-blocks-do-not-divide-rows", _type("blk.0.ffn_gate_exps.weight", T.Q4_K),
     r"tensor 'blk.0.ffn_gate_exps.weight' of type Q4_K and shape \[4, 64, 64\]: its rows of 64 values are not a whole "
     r"number of the type's 256-value blocks"),
    ("unknown-type", _type("blk.0.attn_k.weight", 99),
     r"tensor 'blk.0.attn_k.weight' has GGML type id 99, which is not a GGML type"),
    ("offset-past-the-end", _offset("blk.1.attn_q.weight", 1 << 40),
     r"tensor 'blk.1.attn_q.weight' of type F32 and shape \[64, 64\] needs 16384 bytes from byte \d+, but the file "
     r"holds 0 bytes from there \(it ends at byte \d+\)"),
    ("offset-u64-max", _offset("blk.1.attn_q.weight", (1 << 64) - 32),
     r"tensor 'blk.1.attn_q.weight' of type F32 and shape \[64, 64\] needs 16384 bytes from byte \d{20}, but the file "
     r"holds 0 bytes from there \(it ends at byte \d+\)"),
    ("offset-misaligned", _moved("blk.0.attn_k.weight", "blk.0.attn_k.weight", 4),
     r"tensor 'blk.0.attn_k.weight' has data offset \d+ \(byte \d+\), not a multiple of the file's alignment of 32 bytes "
     r"\(general.alignment\)"),
    ("shape-dim-0", _dim("blk.0.attn_v.weight", 1, 0),
     r"tensor 'blk.0.attn_v.weight' has shape \[0, 64\]: every dimension must be at least 1"),
    ("shape-dim-huge", _dim("blk.0.attn_v.weight", 1, 1 << 62),
     r"tensor 'blk.0.attn_v.weight' of type F32 and shape \[4611686018427387904, 64\] needs 1180591620717411303424 bytes "
     r"from byte \d+, but the file holds \d+ bytes from there \(it ends at byte \d+\)"),
    ("duplicate-name", _renamed("blk.1.attn_q.weight", "blk.0.attn_q.weight"),
     r"tensor 'blk.0.attn_q.weight' is listed twice in the tensor table"),
    ("head-count-0", _u32(HC, 0), HC + " " + W.format(1, 1024, 0)),
    ("head-count-negative", _value(HC, "<i", -4, V.INT32), HC + " " + W.format(1, 1024, -4)),
    ("head-count-huge", _u32(HC, 0xFFFFFFFF), HC + " " + W.format(1, 1024, 4294967295)),
    ("head-count-float", _value(HC, "<f", 4.0, V.FLOAT32), HC + r" must be a whole number, got 4\.0"),
    ("head-count-not-dividing-hidden", _u32(HC, 6),
     r"llama.embedding_length \(64\) must be a multiple of llama.attention.head_count \(6\) when "
     r"llama.attention.key_length is not given"),
    ("kv-heads-not-dividing-heads", _u32("llama.attention.head_count_kv", 3),
     r"llama.attention.head_count \(4\) must be a multiple of llama.attention.head_count_kv \(3\)"),
    ("kv-heads-0", _u32("llama.attention.head_count_kv", 0), "llama.attention.head_count_kv " + W.format(1, 1024, 0)),
    ("hidden-0", _u32("llama.embedding_length", 0), "llama.embedding_length " + W.format(1, 65536, 0)),
    ("block-count-0", _u32("llama.block_count", 0), "llama.block_count " + W.format(1, 1024, 0)),
    ("block-count-huge", _u32("llama.block_count", 1 << 31), "llama.block_count " + W.format(1, 1024, 1 << 31)),
    ("expert-count-0-used-2", _u32("llama.expert_count", 0),
     r"llama.expert_count is missing or 0: a dense model, not an MoE"),
    ("expert-count-huge", _u32("llama.expert_count", 1 << 20), "llama.expert_count " + W.format(1, 4096, 1 << 20)),
    ("top-k-over-experts", _u32("llama.expert_used_count", 5),
     r"llama.expert_used_count \(5\) must be at most llama.expert_count \(4\)"),
    ("top-k-0", _u32("llama.expert_used_count", 0), "llama.expert_used_count " + W.format(1, 4096, 0)),
    ("expert-size-0", _u32("llama.feed_forward_length", 0), "llama.feed_forward_length " + W.format(1, 1048576, 0)),
    ("context-0", _u32("llama.context_length", 0), "llama.context_length " + W.format(1, 16777216, 0)),
    ("rope-theta-nan", _value("llama.rope.freq_base", "<f", float("nan")),
     r"llama.rope.freq_base must be a finite number, got nan"),
    ("rope-theta-negative", _value("llama.rope.freq_base", "<f", -1.0),
     r"llama.rope.freq_base must lie in \(0, 1e\+12\], got -1"),
    ("epsilon-inf", _value("llama.attention.layer_norm_rms_epsilon", "<f", float("inf")),
     r"llama.attention.layer_norm_rms_epsilon must be a finite number, got inf"),
    ("epsilon-0", _value("llama.attention.layer_norm_rms_epsilon", "<f", 0.0),
     r"llama.attention.layer_norm_rms_epsilon must lie in \(0, 1\], got 0"),
    ("bos-id-float", _value("tokenizer.ggml.bos_token_id", "<f", 1.0, V.FLOAT32),
     r"tokenizer.ggml.bos_token_id must be a whole number, got 1\.0"),
]
CLI_ROWS = ["offset-onto-another", "wider-type-q4_0-as-q8_0", "head-count-0", "rope-theta-nan", "expert-count-0-used-2"]


def _damaged(base, tmp_path, how) -> Path:
    b = bytearray(base["raw"])
    how(b, base)
    out = tmp_path / "bad.gguf"
    out.write_bytes(bytes(b))
    return out


def test_the_table_has_its_rows():
    assert len(ROWS) >= 15 and len({r[0] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("how,message", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_damaged_gguf_is_refused_naming_the_file_and_the_tensor_or_key(base, tmp_path, how, message):
    from toolkit.gguf.read import gguf_info

    path = _damaged(base, tmp_path, how)
    for read in (gguf_info, lambda p: load_model(p, backend="numpy")):
        with pytest.raises(ModelError) as e:
            read(path)
        assert re.fullmatch(re.escape(str(path)) + ": " + message, str(e.value)), str(e.value)


@pytest.mark.parametrize("row", CLI_ROWS)
def test_cli_prints_one_line_and_rc_2_for_a_damaged_gguf(base, tmp_path, capsys, row):
    from toolkit.cli import main

    path = _damaged(base, tmp_path, dict((r[0], r[1]) for r in ROWS)[row])
    for argv in (["info", "--model", str(path)],
                 ["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2", "--backend", "numpy"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(path) in err, err
        assert "internal error" not in err and "Traceback" not in err


def test_the_valid_file_loads_and_runs_as_the_checkpoint(base):
    from toolkit.gguf.read import gguf_info

    cfg, rows = gguf_info(base["path"])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.num_layers, cfg.num_experts, cfg.top_k) == (4, 2, 2, 4, 2)
    back, tok = load_model(base["path"], backend="numpy")
    ours, _ = load_model(base["ckpt"], backend="numpy", policy=parse_policy("moqe", "q4_0"))
    ids = [1, 5, 9, 13]
    a = back.forward(np.array([ids]), back.new_cache(1, 8))
    b = ours.forward(np.array([ids]), ours.new_cache(1, 8))
    assert np.array_equal(a, b)
    params = SamplingParams(max_new_tokens=3)
    tokens = [[e.token for e in generate_tokens(m, [ids], params)] for m in (back, ours)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3


@pytest.mark.parametrize("row", ["offset-onto-another", "wider-type-q4_0-as-q8_0", "offset-misaligned"])
def test_the_layout_is_checked_even_without_the_readers_hook(base, tmp_path, monkeypatch, row):
    """A gguf package whose reader never calls ``_build_tensors`` (its internal API changed): the same checks run on
    the tensors it has read, before any is used."""
    from toolkit.gguf import read

    class Plain(gguf.GGUFReader):  # no hook: builds its tensors unchecked
        def __init__(self, path, where):
            self.checked = False
            super().__init__(path)

    monkeypatch.setattr(read, "_reader_class", lambda: Plain)
    how, message = next(r[1:] for r in ROWS if r[0] == row)
    path = _damaged(base, tmp_path, how)
    with pytest.raises(ModelError) as e:
        read.open_gguf(path)
    assert re.fullmatch(re.escape(str(path)) + ": " + message, str(e.value)), str(e.value)
    assert read.open_gguf(base["path"]).tensors  # the valid file passes
