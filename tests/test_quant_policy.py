"""Quantization policies: which weight gets which format, overrides, streaming quantization, bad input."""
from __future__ import annotations

import numpy as np
import pytest

import tiny_model
from toolkit.errors import FormatError
from toolkit.formats import QTensor, get_format
from toolkit.model import Checkpoint, load_config, load_weights
from toolkit.quant import QuantReport, parse_policy, quantizing_transform

# (preset, role) -> quantized?
ROLE_TABLE = [
    ("moqe", "moe.gate_up", True), ("moqe", "moe.down", True), ("moqe", "attn.q", False), ("moqe", "moe.router", False),
    ("moqe", "moe.shared_gate_up", False), ("moqe", "embed", False), ("moqe", "lm_head", False),
    ("all-linear", "attn.o", True), ("all-linear", "moe.shared_down", True), ("all-linear", "mlp.gate_up", True),
    ("all-linear", "moe.router", False), ("all-linear", "moe.shared_gate", False), ("all-linear", "embed", False),
    ("none", "moe.gate_up", False),
]


@pytest.mark.parametrize("preset,role,quantized", ROLE_TABLE)
def test_presets(preset, role, quantized):
    p = parse_policy(preset, None if preset == "none" else "int3-g64")
    fmt = p.format_for(role, f"model.layers.0.{role}", 0)
    assert (fmt is not None) == quantized
    if quantized:
        assert fmt.spec == "int3-g64"


def test_overrides_first_match_wins_and_none_keeps_precision():
    p = parse_policy("moqe", "int2", ["layers\\.1\\.moe\\.down=int8", "w2=int4-g128", "layers.0.moe.gate_up=none"])
    assert p.format_for("moe.down", "model.layers.1.block_sparse_moe.experts.*.w2", 1).spec == "int8"
    assert p.format_for("moe.down", "model.layers.0.block_sparse_moe.experts.*.w2", 0).spec == "int4-g128"
    assert p.format_for("moe.gate_up", "x", 0) is None
    assert p.format_for("moe.gate_up", "x", 1).spec == "int2-g64"
    assert p.format_for("moe.router", "model.layers.1.block_sparse_moe.gate.weight", 1) is None  # never overridden


@pytest.mark.parametrize("args,message", [
    (("moqe", None), "needs a format"), (("fancy", "int4"), "unknown policy 'fancy'"),
    (("moqe", "int5"), "unknown format 'int5'"), (("moqe", "int4", ["down"]), "must look like REGEX=FORMAT"),
    (("moqe", "int4", ["(=int8"]), "bad regular expression"),
])
def test_bad_policies(args, message):
    with pytest.raises(FormatError, match=message):
        parse_policy(*args)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4-g32", "int3-g64", "int2-g32", "q4_0"])
def test_streaming_quantization_matches_whole_tensor(tmp_path, fmt):
    """Expert-by-expert quantization equals quantizing the stacked tensor at once; the report is complete."""
    d = tiny_model.write(tmp_path / "m")
    cfg = load_config(d)
    report = QuantReport("moqe")
    w = load_weights(Checkpoint(d), cfg, transform=quantizing_transform(parse_policy("moqe", fmt), "numba", report))
    dense = load_weights(Checkpoint(d), cfg)
    for i, layer in enumerate(w.layers):
        q = layer.moe["gate_up"]
        assert isinstance(q, QTensor) and q.shape == dense.layers[i].moe["gate_up"].shape
        whole = get_format(fmt).quantize(dense.layers[i].moe["gate_up"], "numba")
        for k in q.arrays:
            assert np.array_equal(q.arrays[k], whole.arrays[k])
        assert isinstance(layer.attn["q"], np.ndarray)  # attention untouched under moqe
    formats = {r["role"]: r["format"] for r in report.rows}
    assert formats["moe.gate_up"] == formats["moe.down"] == get_format(fmt).spec
    assert formats["attn.q"] == formats["moe.router"] == formats["embed"] == "f32"


QUANT_MODEL_CASES = [("moqe", "int8"), ("moqe", "fp8"), ("moqe", "int4-g32"), ("moqe", "int3-g64"), ("moqe", "int2-g32"),
                     ("moqe", "q4_0"), ("all-linear", "int4-g64"), ("all-linear", "fp8")]


@pytest.mark.parametrize("preset,fmt", QUANT_MODEL_CASES)
def test_quantized_model_numba_matches_reference(tmp_path, preset, fmt):
    """The whole model with quantized weights: Numba (fused pipeline, qlinear) == NumPy reference; and for
    weight-only formats, == the dense model holding the dequantized weights (no hidden requantization)."""
    from toolkit.model import MoEModel

    d = tiny_model.write(tmp_path / "m")
    ids = np.random.default_rng(2).integers(3, 64, (1, 10))
    logits = {}
    for backend in ("numpy", "numba"):
        cfg = load_config(d)
        w = load_weights(Checkpoint(d), cfg, transform=quantizing_transform(parse_policy(preset, fmt), backend))
        model = MoEModel(cfg, w, backend)
        logits[backend] = model.forward(ids, model.new_cache(1, 10))
        if backend == "numpy":
            qw = w
    scale = np.abs(logits["numpy"]).max()
    assert np.abs(logits["numba"] - logits["numpy"]).max() <= 1e-4 * scale
    if get_format(fmt).act_quant is None:  # weight-only: equal to the dense model on dequantized weights
        def deq(x):
            return x.dequantize("numpy") if isinstance(x, QTensor) else x
        for layer in qw.layers:
            layer.attn = {k: deq(v) for k, v in layer.attn.items()}
            layer.moe = {k: deq(v) for k, v in layer.moe.items()}
        dense = MoEModel(cfg, qw, "numpy")
        assert np.abs(dense.forward(ids, dense.new_cache(1, 10)) - logits["numpy"]).max() <= 1e-4 * scale
