"""UQFF bundles: round trip (exact logits vs the model quantized in memory), layout facts, CLI, and an
interrupted save (killed mid-write) that leaves the previous bundle intact."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_uqff_support import ROOT, build, logits, read_items, reference_logits, tiny_checkpoint, tiny_qwen2_moe
from toolkit.cli import main
from toolkit.formats import QTensor
from toolkit.load import load_model
from toolkit.quant import parse_policy
from toolkit.uqff import UQFFError, inspect_bundle, load_bundle, spec

# (preset, format, expected UQFF tag of the quantized layers)
ROUND_TRIP = [
    ("moqe", "int3", spec.TAG_MOQE_AFFINE), ("moqe", "int4-g32", spec.TAG_MOQE_AFFINE),
    ("moqe", "int2-g32", spec.TAG_MOQE_AFFINE), ("moqe", "int8", spec.TAG_MOQE_INT8),
    ("moqe", "fp8", spec.TAG_MOQE_FP8), ("moqe", "q4_0", spec.TAG_GGUF), ("moqe", "q8_0", spec.TAG_GGUF), ("moqe", "mxfp4", spec.TAG_GGUF),
    ("all-linear", "int4", spec.TAG_MOQE_AFFINE), ("all-linear", "fp8", spec.TAG_MOQE_FP8),
    ("all-linear", "q4_0", spec.TAG_GGUF), ("none", None, None),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m")


@pytest.mark.parametrize("preset,fmt,tag", ROUND_TRIP)
def test_round_trip_exact_logits(ckpt, tmp_path, preset, fmt, tag):
    policy = parse_policy(preset, fmt)
    report = build(ckpt, tmp_path / "b", policy, shard_bytes=64 * 1024)
    model, tok = load_bundle(tmp_path / "b")
    np.testing.assert_array_equal(logits(model), reference_logits(ckpt, policy))
    assert {row["tag"] for row in report["layers"]} == ({tag} if tag is not None else set())
    if fmt is not None and preset == "moqe":
        r = report["weights"]
        assert {w["format"] for w in r if w["role"] == "moe.down"} == {policy.format.spec}


# Qwen2-MoE: shared expert (split gate_up), a dense-MLP layer (split gate_up), q/k/v biases, tied head
QWEN_CASES = [("moqe", "int4-g32", {"moe.gate_up", "moe.down"}),
              ("all-linear", "int3-g32", {"moe.gate_up", "moe.down", "moe.shared_gate_up", "moe.shared_down",
                                         "mlp.gate_up", "mlp.down", "attn.q", "attn.k", "attn.v", "attn.o"}),
              ("all-linear", "q8_0", None)]


@pytest.mark.parametrize("preset,fmt,roles", QWEN_CASES)
def test_round_trip_qwen2_moe_shared_dense_bias_tied(tmp_path, preset, fmt, roles):
    ckpt = tiny_qwen2_moe(tmp_path / "q")
    policy = parse_policy(preset, fmt)
    report = build(ckpt, tmp_path / "b", policy, shard_bytes=32 * 1024)
    model, _ = load_bundle(tmp_path / "b")
    np.testing.assert_array_equal(logits(model), reference_logits(ckpt, policy))
    quantized = {w["role"] for w in report["weights"] if w["format"] != "f32"}
    assert roles is None or quantized == roles
    keys = {row["key"] for row in report["layers"]}
    if preset == "all-linear":
        assert {"model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj",
                "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.2.mlp.experts.down_proj"} <= keys


def test_layout_sorted_versioned_capped_shards(ckpt, tmp_path):
    cap = 48 * 1024
    report = build(ckpt, tmp_path / "b", parse_policy("moqe", "int4-g32"), shard_bytes=cap)
    keys_seen = []
    assert len(report["shards"]) > 1
    for s in report["shards"]:
        items = read_items(tmp_path / "b" / s["file"])
        names = [n for n, _ in items]
        assert names[:3] == list(spec.VERSION_KEYS)  # the shard starts with the version tensors
        assert [int(a) for _, a in items[:3]] == list(spec.VERSION)
        assert all(a.dtype == np.uint32 and a.shape == () for _, a in items[:3])
        keys_seen += names[3:]
        data = sum(a.nbytes for _, a in items[3:])
        assert data <= cap or s["layers"] == 1
    assert keys_seen == sorted(keys_seen)  # sorted across shards
    assert any(k.endswith(".experts.gate_proj.weight") for k in keys_seen)
    assert any(k.endswith(".experts.up_proj.weight") for k in keys_seen)
    assert sorted(os.listdir(tmp_path / "b")) == sorted(
        [s["file"] for s in report["shards"]] + [spec.RESIDUAL, spec.REPORT, "config.json", "tokenizer.json", "tokenizer_config.json"])
    assert report["source"]["path"] == str(ckpt.resolve()) and len(report["source"]["config_sha256"]) == 64


def test_gate_up_split_is_exact(ckpt, tmp_path):
    """gate_proj/up_proj on disk are exactly the gate and up halves of the in-memory gate_up."""
    from toolkit.model import Checkpoint, load_config, load_weights
    from toolkit.quant import quantizing_transform
    from toolkit.uqff.reader import Bundle

    policy = parse_policy("moqe", "q4_0")
    build(ckpt, tmp_path / "b", policy)

    b = Bundle(tmp_path / "b")
    gu = b.layer("model.layers.0.block_sparse_moe.experts.gate_proj")
    up = b.layer("model.layers.0.block_sparse_moe.experts.up_proj")
    assert isinstance(gu, QTensor) and gu.shape == (4, 64, 64)
    w = load_weights(Checkpoint(ckpt), load_config(ckpt), transform=quantizing_transform(policy, "numba"))
    whole = w.layers[0].moe["gate_up"].arrays["blocks"]  # [E, 2I, bytes]
    assert np.array_equal(gu.arrays["blocks"], whole[:, :64]) and np.array_equal(up.arrays["blocks"], whole[:, 64:])
    assert isinstance(gu.arrays["blocks"].base, np.ndarray)  # a view into the mapped shard, not a copy


def test_bundled_model_int3_exact(tmp_path):
    """The issue's command on the bundled model: moqe int3, logits equal to the in-memory quantization."""
    model_dir = ROOT / "data" / "model"
    policy = parse_policy("moqe", "int3")
    build(model_dir, tmp_path / "b", policy)
    model, tok = load_model(tmp_path / "b")  # load_model dispatches on a bundle
    np.testing.assert_array_equal(logits(model), reference_logits(model_dir, policy))
    assert tok.encode("hello") == load_model(model_dir)[1].encode("hello")


def test_cli_quantize_out_inspect_generate(ckpt, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["quantize", "--model", str(ckpt), "--policy", "moqe", "--experts", "int3", "--out", str(out),
                 "--shard-size", "32KiB"]) == 0
    assert main(["uqff", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "UQFF 1.2.0" in text and "int3-g64" in text and "MoqeAffine" in text
    info = inspect_bundle(out)
    assert info["formats"][0]["layers"] == 6 and info["version"] == "1.2.0"
    assert main(["generate", "--model", str(out), "--prompt", "", "--max-new-tokens", "2", "--ignore-eos"]) == 0
    assert main(["generate", "--model", str(out), "--experts", "int4", "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert "never requantized" in capsys.readouterr().err


def test_save_replaces_previous_bundle(ckpt, tmp_path):
    out = tmp_path / "b"
    build(ckpt, out, parse_policy("moqe", "int4"))
    build(ckpt, out, parse_policy("moqe", "int8"))
    assert json.loads((out / spec.REPORT).read_text())["policy"] == "moqe:int8"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no staging or old folder left behind


@pytest.mark.parametrize("kill_after", [0, 1])
def test_interrupted_save_keeps_previous_bundle(ckpt, tmp_path, kill_after):
    out = tmp_path / "b"
    old_policy = parse_policy("moqe", "int4")
    build(ckpt, out, old_policy)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code = ("import sys; from toolkit.uqff import save_bundle; from toolkit.quant import parse_policy; "
            "save_bundle(sys.argv[1], sys.argv[2], parse_policy('moqe', 'int3'), shard_bytes=16 * 1024)")
    env = dict(os.environ, **{spec.KILL_AFTER_SHARD_ENV: str(kill_after)})
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt), str(out)], env=env, cwd=ROOT, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous bundle, byte for byte
    model, _ = load_bundle(out)
    np.testing.assert_array_equal(logits(model), reference_logits(ckpt, old_policy))
    staging = [p for p in tmp_path.iterdir() if p.name != "b"]
    assert len(staging) == 1 and spec.STAGING_PREFIX in staging[0].name
    assert any(staging[0].glob("*.uqff"))  # half written ...
    with pytest.raises(UQFFError, match="not a complete UQFF bundle"):  # ... and it does not load
        load_bundle(staging[0])


def test_next_save_removes_stale_staging_and_rejects_bundle_source(ckpt, tmp_path):
    out = tmp_path / "b"
    build(ckpt, out, parse_policy("moqe", "int4"))
    stale = tmp_path / f".b{spec.STAGING_PREFIX}999999999"  # a pid that cannot exist
    stale.mkdir()
    (stale / "model-0.uqff").write_bytes(b"half")
    build(ckpt, out, parse_policy("moqe", "int3"))
    assert [p.name for p in tmp_path.iterdir()] == ["b"]
    with pytest.raises(UQFFError, match="is a UQFF bundle; quantize from the original checkpoint"):
        build(out, tmp_path / "c", parse_policy("moqe", "int4"))


@pytest.mark.parametrize("text,nbytes", [("10GiB", 10 * 1024 ** 3), ("512MiB", 512 * 1024 ** 2), ("32KiB", 32768),
                                         ("1000", 1000), ("2GB", 2 * 1024 ** 3)])
def test_shard_size_parsing(text, nbytes):
    from toolkit.cli import _size

    assert _size(text) == nbytes


def test_bad_shard_size_is_a_clean_cli_error(ckpt, tmp_path, capsys):
    assert main(["quantize", "--model", str(ckpt), "--experts", "int4", "--out", str(tmp_path / "b"),
                 "--shard-size", "lots"]) == 2
    assert "bad size 'lots'" in capsys.readouterr().err
