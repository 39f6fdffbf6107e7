"""Smoke tests of the anchor and real-shape benches (``python -m toolkit.bench anchors|layer --quick``) and of
the ``anchors`` extra (pyproject.toml and environment.yml name the same mistral.rs pin)."""
from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest
import yaml

from toolkit.bench import anchors, layer
from toolkit.bench.__main__ import SUITES

ROOT = Path(__file__).resolve().parents[1]


def test_suites_registered():
    assert SUITES["anchors"] == "toolkit.bench.anchors" and SUITES["layer"] == "toolkit.bench.layer"


def test_anchors_extra_mirrored_in_environment_yml():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["anchors"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert sorted(extra) == sorted(p for p in pip if not p.startswith("-e")), (extra, pip)
    assert extra == [f"mistralrs=={anchors.MISTRALRS_VERSION}"]


def _rates_ok(rows, engine_prefix):
    mine = [r for r in rows if r["engine"].startswith(engine_prefix)]
    assert mine, rows
    for r in mine:
        assert r["prefill tok/s"] > 0 and r["decode tok/s"] > 0 and math.isfinite(r["decode tok/s"]), r
    return mine


def test_anchors_quick(capsys):
    rows = anchors.run(["--quick"])
    out = capsys.readouterr().out
    assert "conditions:" in out and "load average" in out and ("AVX" in out or "cores" in out)
    ours = _rates_ok(rows, "ours")
    assert {r["weights"] for r in ours} == {"plain", "moqe q4_0"}
    assert all(r["threads"] == 1 and r["prompt"] == 33 for r in ours)
    if anchors.mistralrs_available():
        theirs = _rates_ok(rows, "mistral.rs")
        assert all(r["ours / x decode"] > 0 for r in theirs)
    else:
        assert "pip install -e '.[anchors]'" in out
    assert "| threads | weights" in out  # a markdown table


def test_anchors_without_mistralrs_still_prints_our_rows(monkeypatch, capsys):
    monkeypatch.setattr(anchors, "mistralrs_available", lambda: False)
    rows = anchors.run(["--quick", "--formats", ""])
    out = capsys.readouterr().out
    assert anchors.INSTALL_HINT in out
    assert [r["engine"] for r in rows] == ["ours (numba)"]


def test_anchors_llama_cpp_dir_without_tools_says_so(tmp_path, capsys):
    rows = anchors.run(["--quick", "--formats", "", "--no-mistralrs", "--llama-cpp", str(tmp_path)])
    out = capsys.readouterr().out
    assert "llama.cpp rows skipped" in out and "llama-bench" in out
    assert [r["engine"] for r in rows] == ["ours (numba)"]


def test_layer_checkpoint_streams_a_valid_safetensors_file(tmp_path):
    from toolkit.model import Checkpoint, load_config

    cfg = layer.layer_config(layer.QUICK)
    layer.write_checkpoint(tmp_path, cfg)
    c = load_config(tmp_path)
    assert (c.hidden_size, c.num_experts, c.head_dim) == (256, 8, 32)
    ck = Checkpoint(tmp_path)
    for name, shape in layer.tensor_shapes(cfg):
        assert tuple(ck.get_f32(name).shape) == shape
    w = ck.get_f32("model.layers.0.block_sparse_moe.experts.7.w2.weight")
    assert 0.015 < float(w.std()) < 0.025


@pytest.mark.parametrize("shape", ["mixtral", "qwen3-30b-a3b"])
def test_layer_quick(shape, capsys):
    rows = layer.run(["--quick", "--shape", shape, "--layers", "2"])
    out = capsys.readouterr().out
    assert "conditions:" in out and "fp32 BLAS ceiling" in out and "| experts | activations | threads" in out
    assert f"2 {shape}-shaped layer(s)" in out
    assert [(r["experts"], r["activations"], r["threads"]) for r in rows] == [("q4_0", "f32", 1), ("q4_0", "int8", 1)]
    for r in rows:
        assert r["prompt"] == 16 and r["load s"] > 0 and r["prefill tok/s"] > 0 and r["decode tok/s"] > 0
        assert r["fp32 BLAS ceiling tok/s"] > 0 and r["of ceiling"] > 0 and r["peak RSS GB"] > 0


def test_layer_write_only_writes_the_vocabulary_asked_and_reuses_it(tmp_path, capsys):
    """``bench layer --write-only --vocab N``: the checkpoint with N embedding / head rows, and nothing run; a
    second call finds it there."""
    from toolkit.model.checkpoint import Checkpoint

    argv = ["--quick", "--write-only", "--vocab", "9000", "--checkpoint", str(tmp_path / "ck")]
    assert layer.run(argv) == []
    ck = Checkpoint(tmp_path / "ck")
    assert ck.get("model.embed_tokens.weight").shape == ck.get("lm_head.weight").shape == (9000, 256)
    assert layer.run(argv) == []
    assert capsys.readouterr().out.splitlines()[-1].endswith("already there)")
    with pytest.raises(SystemExit):
        layer.run(["--quick", "--write-only", "--vocab", "9000"])  # where to?


def test_layer_shapes_are_the_real_models():
    """The Qwen3-30B-A3B-shaped checkpoint is read as that family, with its exact layer (config.json of the release)."""
    from toolkit.model.config import config_from_dict

    cfg = config_from_dict(layer.layer_config(layer.QWEN3_30B_A3B, 48))
    assert cfg.family.name == "Qwen3MoeForCausalLM" and cfg.qk_norm == "head"
    assert (cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.expert_intermediate, cfg.num_layers) == (2048, 128, 8, 768, 48)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 4, 128)
    names = dict(layer.tensor_shapes(layer.layer_config(layer.QWEN3_30B_A3B, 1)))
    assert names["model.layers.0.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert names["model.layers.0.self_attn.q_norm.weight"] == (128,)


def test_quality_configs_keep_one_full_precision_row():
    """``--presets none,moqe`` used to list the full-precision baseline once per width."""
    from toolkit.bench.quality import configs

    assert configs(["int4", "q4_0"], ["none", "moqe"]) == [("none", None), ("moqe", "int4"), ("moqe", "q4_0")]


def test_memory_rows_name_each_load_path(tmp_path):
    """bench memory: one fresh process per load path, its peak taken from the kernel (wait4), the weights it holds
    no more than that peak, and a row that failed says why instead of printing numbers."""
    from toolkit.bench import memory

    model = str(ROOT / "data" / "model")
    rows = memory.run(["--model", model, "--experts", "q4_0", "--model", str(tmp_path / "missing.gguf"),
                       "--prompt-tokens", "8", "--new-tokens", "2"])
    ok, bad = rows
    assert ok["load path"] == "checkpoint + quantize q4_0" and not ok["note"], ok
    assert 0 < ok["weights GB"] < ok["RSS after load GB"] <= ok["peak GB"], ok
    assert bad["peak GB"] is None and bad["note"], bad


def test_runtime_rows_carry_the_peak_of_their_own_load(capsys):
    """bench runtime prints peak RSS beside every speed row: the process's peak since that policy's load began (the
    peak reset before each load), so a small model's row after a big allocation does not carry the allocation."""
    import numpy as np

    from toolkit.bench import runtime
    from toolkit.mapped import reset_peak, resident

    if not reset_peak():
        pytest.skip("this kernel does not reset the peak resident set (/proc/self/clear_refs)")
    big = np.ones(500_000_000 // 8)  # 500 MB, touched, then dropped
    lifetime = resident()["peak"]
    del big
    rows = runtime.run(["--experts", "q4_0", "--prompt-tokens", "16", "--new-tokens", "2"])
    assert rows and all(0 < r["peak RSS GB"] * 1e9 < lifetime - 250e6 for r in rows), (rows, lifetime)
    assert "peak RSS GB" in capsys.readouterr().out
