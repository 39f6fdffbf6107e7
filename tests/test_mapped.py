"""Mapped weights held once: pages of a read-only file mapping released after packing (toolkit/mapped.py), joined
tensors kept as their parts (JoinedArrays), and the CPU packing done expert by expert equal to the whole packing,
byte for byte, for every format with a Numba decoder."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from toolkit.cpu import decoders
from toolkit.cpu.decoders import decoder_for
from toolkit.errors import FormatError
from toolkit.formats import FORMATS, get_format
from toolkit.formats.base import JoinedArrays, QTensor
from toolkit.mapped import release, resident
from toolkit.uqff.keys import join_rows

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page release is Linux-only (/proc/self/maps)")
MB = 1 << 20


def _mapped(tmp_path, data: np.ndarray, mode: str = "r") -> np.ndarray:
    p = tmp_path / "w.bin"
    data.tofile(p)
    return np.memmap(p, dtype=data.dtype, mode=mode, shape=data.shape)


@linux
def test_release_drops_a_read_only_mapping_and_keeps_its_bytes(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 32 * MB, dtype=np.uint8)
    m = _mapped(tmp_path, data)
    before = resident()["file"]
    assert int(m.sum(dtype=np.uint64)) == int(data.sum(dtype=np.uint64))  # every page touched: resident here
    touched = resident()["file"]
    assert touched - before >= 30 * MB
    assert release([m]) >= 32 * MB - 2 * 4096
    assert touched - resident()["file"] >= 30 * MB  # this process no longer holds them
    assert np.array_equal(m, data)  # faulted back in from the file, same bytes


@linux
@pytest.mark.parametrize("kind", ["anonymous read-only view", "writable file mapping", "copy-on-write mapping"])
def test_release_leaves_memory_that_is_not_a_read_only_file_alone(tmp_path, kind):
    data = np.random.default_rng(1).integers(0, 255, 2 * MB, dtype=np.uint8)
    if kind == "anonymous read-only view":
        a = data.copy()
        a.flags.writeable = False
    else:
        a = _mapped(tmp_path, data, "r+" if kind == "writable file mapping" else "c")
        a.flags.writeable = False  # looks read-only to NumPy; the mapping itself is writable
    assert release([a]) == 0
    assert np.array_equal(a, data)


def _stacked(spec: str, shape=(3, 12, 256), seed=0) -> QTensor:
    w = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(0.05)
    return get_format(spec).quantize(w, "numpy", name="w")


# every format with a CPU decoder (one group size each), 256 inputs: a whole k-quant super-block
PACKED = [f.name if not f.group_sizes else f"{f.name}-g{f.group_sizes[-1]}"
          for f in FORMATS.values() if decoder_for(f) is not None]


@pytest.mark.parametrize("shape", [(3, 12, 256), (12, 256)], ids=["stacked", "2-D"])
@pytest.mark.parametrize("spec", PACKED)
def test_joined_tensor_packs_piece_by_piece_as_the_whole(spec, shape, monkeypatch):
    monkeypatch.setattr(decoders, "PIECE_ROWS", 5)  # pieces of 5, 5 and 2 rows in each part
    gate, up = _stacked(spec, shape, seed=2), _stacked(spec, shape, seed=3)
    joined = join_rows([gate, up])
    assert isinstance(joined.arrays, JoinedArrays)
    assert all(not isinstance(sub.arrays, JoinedArrays) for _, _, sub in joined.pieces(5))  # views, no concatenation
    whole = QTensor(joined.fmt, joined.shape, {k: joined.arrays[k] for k in joined.arrays})  # materialized once
    assert joined.nbytes == whole.nbytes == gate.nbytes + up.nbytes
    dec = decoder_for(joined.fmt)
    got, want = decoders.pack_experts(dec, joined), dec.pack(whole)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(g, w)
    np.testing.assert_array_equal(joined.dequantize("numpy"), whole.dequantize("numpy"))


@pytest.mark.parametrize("shape", [(3, 12, 256), (12, 256)], ids=["stacked", "2-D"])
@pytest.mark.parametrize("spec", PACKED)
def test_a_weight_quantized_here_keeps_one_copy(spec, shape):
    """prepare_weight on a tensor quantized in this process: where the packing rebuilds the stored arrays exactly
    (q4_0, q8_0, mxfp4) the stored copy is dropped and read back from the packing, byte for byte; elsewhere kept."""
    from toolkit.cpu.decoders import PackedArrays, held_arrays
    from toolkit.cpu.moe_gemm import prepare_weight

    qt = _stacked(spec, shape, seed=4)
    want = {k: np.array(v) for k, v in qt.arrays.items()}
    nbytes = qt.nbytes
    assert prepare_weight(qt) is qt
    dropped = decoder_for(qt.fmt).unpack is not None
    assert isinstance(qt.arrays, PackedArrays) == dropped
    assert qt.nbytes == nbytes and sorted(qt.arrays) == sorted(want)
    for k, v in want.items():
        got = qt.arrays[k]
        assert got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got.view(np.uint8), v.view(np.uint8))
    held = held_arrays(qt)
    assert not any(np.may_share_memory(h, v) for h in held for v in want.values())  # the copies were ours, not views
    if dropped:
        assert qt.stored() == [] and sum(h.nbytes for h in held) <= nbytes * 1.01 + 64


INT_SPECS = ["q4_0", "q8_0", "int8", "int4-g128", "int3-g64", "int2-g32", "q4_k"]  # the integer kernels' formats


@pytest.mark.parametrize("spec", INT_SPECS)
def test_integer_layout_packs_piece_by_piece_as_the_whole(spec, monkeypatch):
    """The integer kernels' packing of a joined tensor, 5 rows at a time (pieces that start inside a 16-row
    vector, parts of 12 rows), equals the packing of the materialized whole, array for array."""
    from toolkit.cpu import igemm_pack

    gate, up = _stacked(spec, (3, 12, 256), seed=2), _stacked(spec, (3, 12, 256), seed=3)
    joined = join_rows([gate, up])
    whole = QTensor(joined.fmt, joined.shape, {k: joined.arrays[k] for k in joined.arrays})
    want = igemm_pack.pack(whole)
    monkeypatch.setattr(igemm_pack, "PACK_ROWS", 5)
    got = igemm_pack.pack(joined)
    for g, w in zip(got.arrays, want.arrays):
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
    assert (got.bits, got.offset, got.bpg, got.bpz) == (want.bits, want.offset, want.bpg, want.bpz)


@pytest.mark.parametrize("spec", ["q4_0", "q8_0"])
def test_block_packing_in_one_pass_is_the_spec_codes(spec):
    """GGML blocks packed in one pass (igemm_pack._pack_blocks) equal the spec's integer codes and scales
    (toolkit.formats.int_form.int_weight) put through the generic packer, 7 rows at a time."""
    from toolkit.cpu import igemm_pack as ip
    from toolkit.formats.int_form import int_weight

    w = _stacked(spec, (3, 40, 256), seed=6)
    got = ip.pack(w)
    N, K = w.shape[-2:]
    codes, S = np.zeros_like(got.codes), np.zeros_like(got.S)
    for e, n0, sub in w.pieces(7):
        iw = int_weight(sub)
        c = np.ascontiguousarray(iw["c"][0])
        ip._pack_rows(c.size, c, n0, ip.code_bits(w.fmt), codes[e])
        ip._put_lanes(S[e], n0, iw["S"][0])
    assert np.array_equal(got.codes, codes) and np.array_equal(got.S, S)
    assert got.offset == int_weight(w)["o"] and (got.bpg, got.bpz) == (1, 0)


@pytest.mark.parametrize("shape", [(3, 40, 256), (37, 256)], ids=["stacked", "2-D odd rows"])
@pytest.mark.parametrize("spec", INT_SPECS)
def test_int8_activations_keep_one_copy_in_the_integer_layout(spec, shape, monkeypatch):
    """With int8 activations prepare_weight packs a weight quantized here in the integer kernels' layout only: the
    stored arrays are dropped and read back from it byte for byte, and no f32-kernel packing is made."""
    from toolkit.cpu import igemm_pack, moe_gemm
    from toolkit.cpu.decoders import PackedArrays, held_arrays

    monkeypatch.setattr(moe_gemm, "DEFAULT_ACTIVATIONS", "int8")
    qt = _stacked(spec, shape, seed=5)
    want = {k: np.array(v) for k, v in qt.arrays.items()}
    assert moe_gemm.prepare_weight(qt) is qt and isinstance(qt.arrays, PackedArrays)
    for k, v in want.items():
        got = qt.arrays[k]
        assert got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got.view(np.uint8), v.view(np.uint8))
    held = held_arrays(qt)
    assert sorted(id(a) for a in held) == sorted(id(a) for a in igemm_pack.packed(qt).arrays)  # that packing alone


@pytest.mark.parametrize("act", ["f32", "int8"])
@pytest.mark.parametrize("spec", ["q4_0", "q8_0", "int4-g128", "q4_k"])
def test_info_estimate_is_what_a_load_holds(spec, act, monkeypatch):
    """`moqe info`'s expected resident bytes against what the loaded bundled model holds (resident_bytes)."""
    from toolkit.load import load_model
    from toolkit.model import load_config
    from toolkit.model.inspect import resident_estimate
    from toolkit.quant import parse_policy

    from toolkit.cpu import moe_gemm

    monkeypatch.setattr(moe_gemm, "DEFAULT_ACTIVATIONS", act)
    model_dir = Path(__file__).resolve().parents[1] / "data" / "model"
    (row,) = resident_estimate(load_config(model_dir), formats=(spec,))
    model, _ = load_model(model_dir, backend="numba", policy=parse_policy("moqe", spec))
    held = model.resident_bytes()
    assert abs(row["total GB"] * 1e9 - held) <= 0.03 * held, (row, held)


@pytest.mark.parametrize("dtype, spec", [("float16", "f16"), ("bfloat16", "bf16")])
@pytest.mark.parametrize("spoil", [None, "inexact", "inf"])
def test_stored_precision_narrows_row_chunks_exactly_or_not_at_all(monkeypatch, dtype, spec, spoil):
    """The 16-bit embeddings / head are narrowed STORED_ROWS rows at a time (no whole-table f32 copies): the same
    arrays as narrowing at once, and the f32 table back unchanged when any row (here the last chunk's) is not exact."""
    import toolkit.model.runtime as runtime
    from toolkit.formats import get_format

    monkeypatch.setattr(runtime, "STORED_ROWS", 3)
    a = np.arange(10 * 7, dtype=np.float32).reshape(10, 7) / 8  # [10, 7]: 4 chunks, the last one row
    if spoil == "inexact":
        a[9, 6] = 1 / 3
    elif spoil == "inf":
        a[9, 6] = np.inf
    got = runtime.Runtime("numpy").stored_precision(a, dtype)
    if spoil:
        assert got is a
        return
    want = get_format(spec).quantize(a, "numpy", name="weight")
    assert got.fmt.spec == spec and got.shape == a.shape
    assert got.arrays["weight"].dtype == want.arrays["weight"].dtype
    assert np.array_equal(got.arrays["weight"].view(np.uint16), want.arrays["weight"].view(np.uint16))


@linux
def test_check_scales_reads_a_mapped_tensor_piece_by_piece_and_hands_its_pages_back(tmp_path, monkeypatch):
    """A GGML block's scale sits in every block: checking a mapped tensor touches every page of it. The check
    reads CHECK_BYTES at a time and releases each piece, so the file never becomes resident whole."""
    import toolkit.formats.base as base

    fmt = get_format("q4_0")
    w = fmt.quantize(np.random.default_rng(2).standard_normal((8, 1024, 2048), dtype=np.float32) * 0.02, "numpy")
    m = _mapped(tmp_path, np.ascontiguousarray(w.arrays["blocks"]))  # [8, 1024, 1152] u8: 9.4 MB
    monkeypatch.setattr(base, "CHECK_BYTES", 1 * MB)
    before = resident()["file"]
    QTensor(fmt, w.shape, {"blocks": m}).check_scales("experts")
    assert resident()["file"] - before < 4 * MB  # at most a piece or two of 9.4 MB stays mapped in


@pytest.mark.parametrize("spec", ["q4_0", "q4_k", "mxfp4", "int4-g32"])
def test_check_scales_in_pieces_names_the_same_count_and_first_index(monkeypatch, spec):
    import toolkit.formats.base as base

    fmt = get_format(spec)
    w = fmt.quantize(np.random.default_rng(3).standard_normal((6, 64, 256), dtype=np.float32) * 0.02, "numpy")
    arrays = {k: np.array(a) for k, a in w.arrays.items()}
    if spec == "int4-g32":
        key = next(k for k, a in arrays.items() if a.dtype.kind == "f")
        arrays[key].reshape(-1)[[-1, -7]] = np.nan  # in the last expert's rows: the last piece
    else:
        b = arrays["blocks"].reshape(-1, arrays["blocks"].shape[-1])
        b[-1, 0:2] = b[-3, 0:2] = 0xFF  # f16 NaN / e8m0 255 (the first bytes of a block) in the last rows
        if spec == "q4_k":
            b[-1, 0:2] = b[-3, 0:2] = np.array([0x00, 0x7C], np.uint8)  # f16 +inf: d of the block
    msgs = []
    for limit in (1 << 40, 1024):  # one piece, then a piece per expert or less
        monkeypatch.setattr(base, "CHECK_BYTES", limit)
        with pytest.raises(FormatError, match="NaN or inf") as e:
            QTensor(fmt, w.shape, arrays).check_scales("t")
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


def _bundled_sources(tmp_path):
    """The bundled model (f16 checkpoint) as each load path reads it: the checkpoint, a UQFF bundle, a GGUF."""
    from toolkit.gguf.export import export_gguf
    from toolkit.quant import parse_policy
    from toolkit.uqff.writer import save_bundle

    model_dir = Path(__file__).resolve().parents[1] / "data" / "model"
    save_bundle(model_dir, tmp_path / "b", parse_policy("moqe", "q4_0"))
    export_gguf(model_dir, tmp_path / "m.gguf", parse_policy("moqe", "q4_0"))
    return {"checkpoint": model_dir, "uqff": tmp_path / "b", "gguf": tmp_path / "m.gguf"}


@pytest.fixture(scope="module")
def bundled_sources(tmp_path_factory):
    return _bundled_sources(tmp_path_factory.mktemp("sources"))


def _loaded_reading_no_f32(sources, source, monkeypatch, refused):
    """(model loaded on numba with every f32 read of a tensor whose name matches ``refused`` failing, the logits of
    the f32 NumPy load of the same source, the ids): the bundled model's checkpoint (q4_0 at load), bundle or GGUF."""
    from toolkit.gguf import read as gguf_read
    from toolkit.load import load_model
    from toolkit.model.checkpoint import Checkpoint
    from toolkit.quant import parse_policy
    from toolkit.uqff import reader as uqff_reader

    policy = parse_policy("moqe", "q4_0") if source == "checkpoint" else None
    ids = np.array([[1, 17, 300, 5]])
    ref, _ = load_model(sources[source], backend="numpy", policy=policy)
    want = ref.forward(ids, ref.new_cache(1, 4))  # [1, 4, V]

    def refuse(orig):
        def get(self, name, *a):
            assert not re.fullmatch(refused, name), f"{name} read as f32"
            return orig(self, name, *a)
        return get

    monkeypatch.setattr(Checkpoint, "get_f32", refuse(Checkpoint.get_f32))
    monkeypatch.setattr(uqff_reader.Bundle, "residual", refuse(uqff_reader.Bundle.residual))
    monkeypatch.setattr(gguf_read._Tensors, "f32", refuse(gguf_read._Tensors.f32))
    model, _ = load_model(sources[source], backend="numba", policy=policy)
    return model, want, ids


@pytest.mark.parametrize("source", ["checkpoint", "uqff", "gguf"])
def test_a_16bit_table_is_kept_as_the_file_stores_it_never_read_as_f32(bundled_sources, source, monkeypatch):
    """The embeddings and LM head of an f16 model are kept as the file stores them, from the load on (a view of
    the mapped file): never widened to f32 on the way (an f32 copy of each table held through the load was most of
    a load's peak over its end). Every f32 read of a table fails here; the logits are the widened load's."""
    tables = r"model\.embed_tokens\.weight|lm_head\.weight|token_embd\.weight|output\.weight"
    model, want, ids = _loaded_reading_no_f32(bundled_sources, source, monkeypatch, tables)
    for table in (model.embed, model.lm_head.weight):
        assert isinstance(table, QTensor) and table.fmt.name == "f16"
        assert not table.arrays["weight"].flags.owndata  # a view of the mapped file, not a copy
    assert model.lm_head.weight is not model.embed  # the bundled model's head is its own tensor
    got = model.forward(ids, model.new_cache(1, 4))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("backend, keeps", [("numba", True), ("numpy", False)])
def test_a_tied_table_is_loaded_once_and_held_once(tmp_path, backend, keeps):
    """A model with tied embeddings: one table object serves as both (16-bit on numba; f32 on numpy below
    HEAD16_MIN_HIDDEN, where the head is read f32), however it was loaded."""
    import json
    import shutil

    from toolkit.load import load_model
    from toolkit.model.checkpoint import Checkpoint
    from toolkit.uqff.writer import write_safetensors

    src = Path(__file__).resolve().parents[1] / "data" / "model"
    d = tmp_path / "tied"
    d.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, d / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    ck = Checkpoint(src)
    write_safetensors(d / "model.safetensors", [(n, np.asarray(ck.get(n))) for n in ck.keys() if n != "lm_head.weight"])
    model, _ = load_model(d, backend=backend)
    assert isinstance(model.embed, QTensor) == keeps
    if keeps:
        assert model.lm_head.weight is model.embed
    else:
        assert np.shares_memory(model.lm_head.weight, model.embed)


@pytest.mark.parametrize("source", ["checkpoint", "uqff", "gguf"])
def test_16bit_projections_are_kept_as_the_file_stores_them_never_read_as_f32(bundled_sources, source, monkeypatch):
    """Attention's projections of an f16 model arrive 16-bit on numba (Runtime.placing, from DENSE16_MIN elements:
    lowered here so the bundled model's count): never widened to f32 on the way (an f32 copy of each, held from its
    read to the model's build, was 160 MB a Mixtral layer), o kept as a view of the file, q / k / v joined as
    stored; the logits are those of the f32 load."""
    from toolkit.model import runtime

    monkeypatch.setattr(runtime, "DENSE16_MIN", 0)
    projections = r".*(self_attn\.[qkvo]_proj|attn_(q|k|v|output))\.weight"
    model, want, ids = _loaded_reading_no_f32(bundled_sources, source, monkeypatch, projections)
    for layer in model.layers:
        qkv, o = layer.attn.qkv.weight, layer.attn.o.weight
        assert isinstance(qkv, QTensor) and qkv.fmt.name == "f16" and isinstance(o, QTensor) and o.fmt.name == "f16"
        assert not o.arrays["weight"].flags.owndata  # a view of the mapped file, not a copy
    got = model.forward(ids, model.new_cache(1, 4))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
