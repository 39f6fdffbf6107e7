"""UQFF validation: one broken bundle per row, each rejected with a UQFFError naming the file (and the
tensor); plus the cases a reader must accept (an older minor, another patch)."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from test_uqff_support import (build, layer_key, logits, read_items, reference_logits, refresh_report, rewrite,
                               tiny_checkpoint)
from toolkit.errors import ToolkitError
from toolkit.quant import parse_policy
from toolkit.uqff import UQFFError, load_bundle, spec

POLICY = parse_policy("all-linear", "int4-g32", ["down=q4_0", "attn.o=int8"])  # three families in one bundle
SHARD = "model-0.uqff"


def _set(name, value):
    return lambda items: [(k, value if k == name else a) for k, a in items]


def _drop(pred):
    return lambda items: [(k, a) for k, a in items if not pred(k)]


def _on_layer(tag, suffix, fn):
    """Edit ``<key><suffix>`` of the first layer of family ``tag`` in whichever shard holds it."""
    def mutate(b):
        shard, key = layer_key(b, tag)
        rewrite(b, shard, lambda items: [(k, fn(a) if k == key + suffix else a) for k, a in items])
    return mutate


def _dup_into_other_shard(b):
    r = json.loads((b / spec.REPORT).read_text())
    first, second = r["shards"][0]["file"], r["shards"][1]["file"]
    key = r["layers"][0]["key"]
    extra = [(k, a) for k, a in read_items(b / first) if k.startswith(key + ".")]
    rewrite(b, second, lambda items: items + extra)


def _lying_offsets(b):
    """Patch the header so one tensor's end offset points past the data (same byte length, report refreshed)."""
    raw = bytearray((b / SHARD).read_bytes())
    n = int.from_bytes(raw[:8], "little")
    head = raw[8:8 + n].decode()
    m = list(re.finditer(r'"data_offsets":\[(\d+),(\d+)\]', head))[-1]
    lo, hi = m.group(1), m.group(2)
    new = f'"data_offsets":[{lo},{"9" * len(hi)}]'
    assert len(new) == len(m.group(0))
    raw[8 + m.start():8 + m.end()] = new.encode()
    (b / SHARD).write_bytes(bytes(raw))
    refresh_report(b, SHARD)


def _truncate(refresh):
    def mutate(b):
        data = (b / SHARD).read_bytes()
        (b / SHARD).write_bytes(data[:-100])
        if refresh:
            refresh_report(b, SHARD)
    return mutate


def _flip_data_byte(b):
    raw = bytearray((b / SHARD).read_bytes())
    raw[-10] ^= 0x55
    (b / SHARD).write_bytes(bytes(raw))


def _remove(name, refresh=False):
    def mutate(b):
        (b / name).unlink()
        if refresh:
            refresh_report(b, name)
    return mutate


def _config_layers(n):
    def mutate(b):
        c = json.loads((b / "config.json").read_text())
        c["num_hidden_layers"] = n
        (b / "config.json").write_text(json.dumps(c))
        refresh_report(b, "config.json")
    return mutate


def _stray_shard(b):
    shutil.copyfile(b / SHARD, b / "model-99.uqff")


def _residual_int(b):
    rewrite(b, spec.RESIDUAL, lambda items: [(k, a.view(np.int16) if k == "model.norm.weight" else a) for k, a in items])


# (case id, mutate(bundle dir), message regex, file the message must name)
ERRORS = [
    ("no-report", _remove(spec.REPORT), "not a complete UQFF bundle", None),
    ("missing-version", lambda b: rewrite(b, SHARD, _drop(lambda k: k == "uqff.version.minor")), "no uqff.version.minor", SHARD),
    ("newer-minor", lambda b: rewrite(b, SHARD, _set("uqff.version.minor", np.array(3, np.uint32))), "version 1.3.0 is not readable", SHARD),
    ("other-major", lambda b: rewrite(b, SHARD, _set("uqff.version.major", np.array(2, np.uint32))), "version 2.2.0 is not readable", SHARD),
    ("version-dtype", lambda b: rewrite(b, SHARD, _set("uqff.version.major", np.array(1, np.uint64))), "expected a U32 scalar", SHARD),
    ("unknown-tag", _on_layer(spec.TAG_MOQE_AFFINE, spec.FORMAT_SUFFIX, lambda a: np.array(77, np.uint8)), "unknown format tag 77", ".weight.format"),
    ("mistralrs-afq-tag", _on_layer(spec.TAG_MOQE_AFFINE, spec.FORMAT_SUFFIX, lambda a: np.array(4, np.uint8)), "mistral.rs family Afq", ".weight.format"),
    ("tag-dtype", _on_layer(spec.TAG_GGUF, spec.FORMAT_SUFFIX, lambda a: np.array(0, np.uint32)), "expected a U8 scalar", ".weight.format"),
    ("key-in-two-shards", _dup_into_other_shard, "is in both model-0.uqff and model-1.uqff", None),
    ("gguf-bytes", _on_layer(spec.TAG_GGUF, ".weight", lambda a: a[:-18]), r"holds \d+ bytes, but q4_0", ".weight'"),
    ("gguf-type-id", _on_layer(spec.TAG_GGUF, ".weight.dtype", lambda a: np.array(16, np.uint32)), "GGML type 16 is not supported", ".weight.dtype"),
    ("gguf-shape-dtype", _on_layer(spec.TAG_GGUF, ".weight.shape", lambda a: a.astype(np.int32)), "is int32, expected uint32", ".weight.shape"),
    ("affine-words", _on_layer(spec.TAG_MOQE_AFFINE, ".weight", lambda a: a[..., :-1]), "does not match format|whole groups", ".weight"),
    ("affine-bits-dtype", _on_layer(spec.TAG_MOQE_AFFINE, ".weight.bits", lambda a: np.array(4, np.uint32)), "is uint32, expected uint8", ".weight.bits"),
    ("affine-bits-value", _on_layer(spec.TAG_MOQE_AFFINE, ".weight.bits", lambda a: np.array(5, np.uint8)), "5 bits is not one of", ".weight.bits"),
    ("affine-group", _on_layer(spec.TAG_MOQE_AFFINE, ".weight.group_size", lambda a: np.array(48, np.uint8)), "does not take group size 48", ".weight.group_size"),
    ("affine-scales-dtype", _on_layer(spec.TAG_MOQE_AFFINE, ".weight.scales", lambda a: a.astype(np.float32)), "expected float16", ".weight.scales"),
    ("int8-scales-shape", _on_layer(spec.TAG_MOQE_INT8, ".weight.scales", lambda a: a[..., :-1]), "does not match format", ".weight"),
    ("missing-entry", lambda b: rewrite(b, layer_key(b, spec.TAG_MOQE_AFFINE)[0],
                                        _drop(lambda k: k == layer_key(b, spec.TAG_MOQE_AFFINE)[1] + ".weight.biases")),
     "weight.biases' is missing from every shard", None),
    ("orphan-entry", lambda b: rewrite(b, SHARD, lambda items: items + [("model.extra.weight.scales", np.zeros(4, np.float16))]),
     "belongs to no layer", SHARD),
    ("missing-residual", _remove(spec.RESIDUAL), "residual.safetensors: missing", spec.RESIDUAL),
    ("missing-residual-unlisted", _remove(spec.RESIDUAL, refresh=True), "does not list residual.safetensors", spec.REPORT),
    ("missing-config", _remove("config.json"), "config.json: missing", "config.json"),
    ("missing-shard", _remove("model-1.uqff"), "model-1.uqff: missing", None),
    ("stray-shard", _stray_shard, "model-99.uqff are not listed", None),
    ("truncated", _truncate(False), "truncated", SHARD),
    ("truncated-report-refreshed", _truncate(True), "outside the data|bytes, but", SHARD),
    ("lying-offsets", _lying_offsets, "outside the data", SHARD),
    ("data-byte-changed", _flip_data_byte, "CRC-32 mismatch", SHARD),
    ("residual-dtype", _residual_int, "expected a float type", spec.RESIDUAL),
    ("residual-tensor-missing", lambda b: rewrite(b, spec.RESIDUAL, _drop(lambda k: k == "model.norm.weight")),
     "no tensor 'model.norm.weight'", spec.RESIDUAL),
    ("config-fewer-layers", _config_layers(1), "not used by config.json", None),
    ("config-more-layers", _config_layers(3), "missing", None),
    ("report-not-json", lambda b: (b / spec.REPORT).write_text("{"), "uqff_report.json: not valid JSON", spec.REPORT),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("uqff_err")
    ckpt = tiny_checkpoint(root / "ckpt")
    build(ckpt, root / "bundle", POLICY, shard_bytes=24 * 1024)
    return ckpt, root / "bundle"


def test_base_bundle_loads(base):
    ckpt, b = base
    np.testing.assert_array_equal(logits(load_bundle(b)[0]), reference_logits(ckpt, POLICY))
    tags = {r["tag"] for r in json.loads((b / spec.REPORT).read_text())["layers"]}
    assert tags == {spec.TAG_GGUF, spec.TAG_MOQE_AFFINE, spec.TAG_MOQE_INT8}


@pytest.mark.parametrize("case,mutate,message,names", ERRORS, ids=[c[0] for c in ERRORS])
def test_rejected(base, tmp_path, case, mutate, message, names):
    b = tmp_path / "b"
    shutil.copytree(base[1], b)
    mutate(b)
    with pytest.raises(UQFFError, match=message) as e:
        load_bundle(b)
    assert isinstance(e.value, ToolkitError)
    assert str(b) in str(e.value)  # names the bundle's file ...
    if names:
        assert names in str(e.value)  # ... and the file or tensor at fault


@pytest.mark.parametrize("version", [(1, 0, 0), (1, 1, 7), (1, 2, 9)])
def test_older_minor_and_any_patch_accepted(base, tmp_path, version):
    ckpt, src = base
    b = tmp_path / "b"
    shutil.copytree(src, b)
    for s in json.loads((b / spec.REPORT).read_text())["shards"]:
        for k, v in zip(spec.VERSION_KEYS, version):
            rewrite(b, s["file"], _set(k, np.array(v, np.uint32)))
    np.testing.assert_array_equal(logits(load_bundle(b)[0]), reference_logits(ckpt, POLICY))
