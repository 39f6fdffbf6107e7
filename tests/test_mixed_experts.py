"""Routed experts at mixed widths (``toolkit/formats/mixed.py``): a layer's experts stored as groups, one stacked
QTensor per format, run as one ``fused_moe`` per (gate_up format, down format) pair and summed
(``toolkit/model/model.py: mixed_experts``); per-expert policy names and overrides; a mixed UQFF bundle (one layer
per expert and projection) and its refusals; GGUF export refused.

Oracle: the same model with every expert weight replaced by its dequantized f32 array, on the NumPy backend
(``moe_experts``, no grouping). Tolerances: numpy / numba / cuda-emu logits within ``TOL`` of the reference's
largest logit (f32 sums in another order; measured <= 1.1e-6 of it); layouts, formats and bundle round trips exact.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import tiny_model
from helpers import assert_close
from test_uqff_support import IDS, read_items, rewrite, tiny_checkpoint

from toolkit.errors import FormatError
from toolkit.formats import QTensor, get_format
from toolkit.formats.mixed import (
    ExpertGroup,
    MixedExperts,
    group_experts,
    pair_groups,
    stack_experts,
)
from toolkit.backend import cuda_unavailable_reason
from toolkit.load import load_model
from toolkit.model import Checkpoint, MoEModel, load_config, load_weights
from toolkit.quant import QuantReport, parse_policy, quantizing_transform
from toolkit.quant.plan import plan_policy, write_plan
from toolkit.uqff import UQFFError, load_bundle, save_bundle, spec

RNG = np.random.default_rng(11)
NO_GPU = cuda_unavailable_reason()
# on a machine with a GPU, on the GPU too (.ci/gpu-check: -k gpu), on its default tensor-core kernels
BACKENDS = ["numpy", "numba", "cuda-emu",
            pytest.param("cuda", id="gpu", marks=pytest.mark.skipif(NO_GPU is not None, reason=str(NO_GPU)))]
TOL = 2e-5  # |err| <= TOL * max|reference logit| (f32, other summation order); measured 1.1e-6
GPU_TOL = 5e-2  # the GPU's tensor cores multiply f16 (int8: bf16) operands: their rounding, not f32's
# E = 6 experts, head dim 32 (the emulated device's attention), both layers MoE
CFG = dict(tiny_model.CONFIG, num_attention_heads=2, num_key_value_heads=1, num_local_experts=6)
# layer -> the format of each expert's gate_up and down ("none": kept f32 inside the mix)
# layer 0: three formats on each side, paired differently -> 6 (gate_up, down) groups
# layer 1: gate_up mixed with one f32 expert, down one format (a plain QTensor) -> 2 groups
PLAN = {
    0: (["int4-g32", "int8", "q8_0", "int4-g32", "int8", "q8_0"], ["q8_0", "q8_0", "int4-g32", "int4-g32", "int8", "int8"]),
    1: (["none"] + ["int4-g32"] * 5, ["int8"] * 6),
}
GROUPS = {0: 6, 1: 2}
PROMPTS = [[3, 5, 7, 9, 11, 13, 2], [4, 6, 8]]  # B = 2, different lengths: prefill T = 7


def plan_lines(plan: dict) -> dict:
    return {f"layers.{i}.moe.{p}.{e}": f for i, (gu, dn) in plan.items() for p, fs in (("gate_up", gu), ("down", dn))
            for e, f in enumerate(fs)}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(cfg, mixed weights quantized by a plan file, the dequantized reference model)."""
    d = tmp_path_factory.mktemp("mixed")
    ckpt = tiny_model.write(d / "m", cfg=CFG)
    cfg = load_config(ckpt)
    write_plan(d / "mix.plan", plan_lines(PLAN), ["test plan"])
    policy = plan_policy(d / "mix.plan", cfg)
    w = load_weights(Checkpoint(ckpt), cfg, transform=quantizing_transform(policy, "numba"))

    def deq(x):
        return x.dequantize("numpy") if isinstance(x, QTensor | MixedExperts) else x

    ref_w = dataclasses.replace(w, layers=[dataclasses.replace(lw, moe={k: deq(v) for k, v in lw.moe.items()})
                                           for lw in w.layers])
    return cfg, w, MoEModel(cfg, ref_w, "numpy")


def _logits_over_steps(model, steps: int = 3) -> list[np.ndarray]:
    """Prefill logits at every valid position of each prompt, then ``steps`` decode steps' logits."""
    T = max(map(len, PROMPTS))
    lens = np.array([len(p) for p in PROMPTS])
    tokens = np.array([p + [0] * (T - len(p)) for p in PROMPTS])
    cache = model.new_cache(len(PROMPTS), T + steps)
    pre = model.rt.host(model.forward(tokens, cache, lengths=lens))  # [B, T, V]
    out = [pre[b, :n] for b, n in enumerate(lens)]
    for s in range(steps):
        out.append(model.rt.host(model.decode(np.array([5 + s, 9 + s]), cache)))  # [B, V]
    return out


def test_plan_gives_each_expert_its_format(mixed):
    _, w, _ = mixed
    for i, (gu, dn) in PLAN.items():
        g = w.layers[i].moe["gate_up"]
        assert isinstance(g, MixedExperts)
        assert [g.format_of(e).spec for e in range(6)] == [("f32" if f == "none" else f) for f in gu]
        d = w.layers[i].moe["down"]
        if len(set(dn)) > 1:
            assert [d.format_of(e).spec for e in range(6)] == dn
        else:  # one format: a plain stacked QTensor
            assert isinstance(d, QTensor) and d.fmt.spec == dn[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_layers_match_the_dequantized_reference(mixed, backend):
    cfg, w, ref = mixed
    model = MoEModel(cfg, w, backend)
    assert [layer.ffn.experts.groups for layer in model.layers] == [GROUPS[0], GROUPS[1]]
    want = _logits_over_steps(ref)
    got = _logits_over_steps(model)
    scale = max(float(np.abs(x).max()) for x in want)
    names = [f"prefill seq {b}" for b in range(len(PROMPTS))] + [f"decode step {s}" for s in range(len(got) - len(PROMPTS))]
    for g, r, name in zip(got, want, names):
        assert_close(g, r, atol=(GPU_TOL if backend == "cuda" else TOL) * scale, what=f"{backend} {name}")


def test_mixed_groups_go_up_repacked_on_an_sm90_device(mixed, monkeypatch):
    """Each (gate_up, down) group of a mixed layer goes up as its own stacked QTensor, so a device with tensor cores
    repacks a packable group as it does any routed experts: on an sm_90 device the int4-g32 and q8_0 groups run on
    the packed decoders (int8 and the f32 expert on theirs), within the tensor cores' rounding of the reference."""
    monkeypatch.setenv("MOQE_EMU_ARCH", "900")
    cfg, w, ref = mixed
    model = MoEModel(cfg, w, "cuda-emu")
    model.rt.device.launched.clear()  # the emulated device is shared: this test's launches only
    got, want = _logits_over_steps(model), _logits_over_steps(ref)
    scale = max(float(np.abs(x).max()) for x in want)
    for g, r in zip(got, want):
        assert_close(g, r, atol=GPU_TOL * scale, what="cuda-emu sm_90")
    launched = {k for k in model.rt.device.launched if k.startswith("moe_gemm")}
    assert {"moe_gemm_mma<AffinePackedDec<4>, OpF16, 16>", "moe_gemm_mma<Q8_0PackedDec, OpF16, 16>",
            "moe_gemm_mma<Int8Dec, OpF16, 16>", "moe_gemm_mma<F32Dec, OpF16, 16>"} <= launched, sorted(launched)
    assert not any(k.startswith("moe_gemm_mma<AffineDec<") or "Q8_0Dec" in k for k in launched), sorted(launched)


# ---- the MixedExperts record -------------------------------------------------------------------------------
def _parts(specs, N=8, K=64):
    w = RNG.standard_normal((len(specs), N, K)).astype(np.float32)
    return w, [get_format(s).quantize(w[e], "numpy") for e, s in enumerate(specs)]


def test_group_experts_layout_and_views():
    specs = ["int8", "int4-g32", "int8", "q8_0", "int4-g32"]
    _, parts = _parts(specs)
    m = group_experts(parts)
    assert isinstance(m, MixedExperts) and m.shape == (5, 8, 64)
    assert [(g.fmt.spec, g.experts) for g in m.groups] == [("int8", (0, 2)), ("int4-g32", (1, 4)), ("q8_0", (3,))]
    assert m.label == "int8x2+int4-g32x2+q8_0x1"
    assert m.nbytes == sum(p.nbytes for p in parts)
    for e, p in enumerate(parts):
        assert m.format_of(e).spec == specs[e]
        one = m.expert(e)
        assert one.shape == (8, 64) and all(np.array_equal(one.arrays[k], p.arrays[k]) for k in p.arrays)
        assert_close(m.dequantize()[e], p.dequantize("numpy"), exact=True, what=f"expert {e}")
    assert [list(m.expert_map(g)) for g in m.groups] == [[0, -1, 1, -1, -1], [-1, 0, -1, -1, 1], [-1, -1, -1, 0, -1]]
    assert isinstance(group_experts(parts[:1] + parts[2:3]), QTensor)  # one format: plain stacked


def test_pair_groups_by_format_pair():
    _, gu = _parts(["int8", "int4-g32", "int8", "int4-g32"], N=16)
    _, dn = _parts(["q8_0", "q8_0", "int8", "q8_0"])
    pairs = pair_groups(group_experts(gu), group_experts(dn))
    assert [(ids, a.fmt.spec, b.fmt.spec) for ids, a, b in pairs] == [
        ((0,), "int8", "q8_0"), ((1, 3), "int4-g32", "q8_0"), ((2,), "int8", "int8")]
    assert pairs[1][1].shape == (2, 16, 64) and pairs[1][2].shape == (2, 8, 64)
    plain = stack_experts(dn[:1] + dn[1:2] + dn[3:4] + dn[1:2])  # one side a plain QTensor (all q8_0)
    assert [ids for ids, _, _ in pair_groups(group_experts(gu), plain)] == [(0, 2), (1, 3)]


# (groups as (format, experts), message): refused layouts
BAD_GROUPS = [
    ([("int8", (0, 1)), ("q8_0", (1, 2))], r"expected each of 0\.\.2 once"),
    ([("int8", (0,)), ("q8_0", (2,))], r"expected each of 0\.\.2 once"),
    ([("int8", (0, 1, 2, 3))], r"expected each of 0\.\.2 once"),
]


@pytest.mark.parametrize("groups,message", BAD_GROUPS)
def test_mixed_experts_refuses_bad_groups(groups, message):
    w = RNG.standard_normal((4, 8, 64)).astype(np.float32)
    gs = tuple(ExpertGroup(ids, get_format(f).quantize(w[list(ids)], "numpy")) for f, ids in groups)
    with pytest.raises(FormatError, match=message):
        MixedExperts((3, 8, 64), gs)


def test_mixed_experts_refuses_a_group_of_the_wrong_shape():
    w = RNG.standard_normal((3, 8, 64)).astype(np.float32)
    gs = (ExpertGroup((0, 1), get_format("int8").quantize(w[:2], "numpy")),
          ExpertGroup((2,), get_format("q8_0").quantize(w[2:, :4], "numpy")))
    with pytest.raises(FormatError, match=r"the q8_0 group of 1 experts has shape \[1, 4, 64\], expected \[1, 8, 64\]"):
        MixedExperts((3, 8, 64), gs)


# ---- per-expert names in policies --------------------------------------------------------------------------
DOWN = "model.layers.0.block_sparse_moe.experts.*.w2"
# (overrides, role, layer, the formats of experts 0..3)
OVERRIDES = [
    ([r"moe\.down\.[0-1]$=int8"], "moe.down", 0, ["int8", "int8", "int4-g32", "int4-g32"]),
    ([r"moe\.down\.[0-1]$=int8"], "moe.gate_up", 0, ["int4-g32"] * 4),
    ([r"experts\.3\.w2=q8_0"], "moe.down", 0, ["int4-g32"] * 3 + ["q8_0"]),  # the checkpoint name of one expert
    ([r"layers\.1\.moe\.down\.2$=none"], "moe.down", 1, ["int4-g32", "int4-g32", None, "int4-g32"]),
    ([r"layers\.1\.moe\.down\.2$=none"], "moe.down", 0, ["int4-g32"] * 4),
    ([r"moe\.down\.0$=int8", r"moe\.down=q8_0"], "moe.down", 0, ["int8", "q8_0", "q8_0", "q8_0"]),  # first match wins
]


@pytest.mark.parametrize("overrides,role,layer,want", OVERRIDES)
def test_overrides_pick_single_experts(overrides, role, layer, want):
    p = parse_policy("moqe", "int4-g32", overrides)
    got = p.expert_formats(role, DOWN.replace("layers.0", f"layers.{layer}"), layer, 4)
    assert [f.spec if f else None for f in got] == want


def test_override_mix_is_quantized_as_mixed_experts_and_reported(tmp_path):
    d = tiny_model.write(tmp_path / "m")
    cfg = load_config(d)
    report = QuantReport("moqe")
    p = parse_policy("moqe", "int4-g32", [r"layers\.1\.moe\.down\.[13]$=int8"])
    w = load_weights(Checkpoint(d), cfg, transform=quantizing_transform(p, "numba", report))
    assert isinstance(w.layers[0].moe["down"], QTensor) and isinstance(w.layers[1].moe["gate_up"], QTensor)
    m = w.layers[1].moe["down"]
    assert isinstance(m, MixedExperts) and m.label == "int4-g32x2+int8x2"
    rows = {r["name"]: r["format"] for r in report.rows if r["role"] == "moe.down"}
    assert rows == {DOWN: "int4-g32", DOWN.replace("layers.0", "layers.1").replace("*", "{0,2}"): "int4-g32",
                    DOWN.replace("layers.0", "layers.1").replace("*", "{1,3}"): "int8"}


# ---- a mixed UQFF bundle -----------------------------------------------------------------------------------
BUNDLE_PLAN = {i: (["int4-g32", "int8", "q8_0", "none"], ["q8_0", "int4-g32", "int4-g32", "int8"]) for i in (0, 1)}
EXPERT_KEY = "model.layers.{i}.block_sparse_moe.experts.{e}.{p}"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """(checkpoint, plan policy, bundle folder, save_bundle's report) of the 4-expert tiny model."""
    d = tmp_path_factory.mktemp("bundle")
    ckpt = tiny_checkpoint(d / "m")
    write_plan(d / "b.plan", plan_lines(BUNDLE_PLAN), [])
    policy = plan_policy(d / "b.plan", load_config(ckpt))
    report = save_bundle(ckpt, d / "b", policy)
    return ckpt, policy, d / "b", report


def test_mixed_bundle_round_trip_is_exact(bundle):
    ckpt, policy, out, _ = bundle
    model, _ = load_bundle(out)
    direct, _ = load_model(ckpt, policy=policy)
    assert [layer.ffn.experts.groups for layer in model.layers] == [4, 4]
    got = model.forward(IDS, model.new_cache(1, IDS.shape[1]))
    want = direct.forward(IDS, direct.new_cache(1, IDS.shape[1]))
    assert_close(got, want, exact=True, what="bundle vs direct")


def test_mixed_bundle_stores_one_layer_per_expert(bundle):
    _, _, out, report = bundle
    want = {}
    for i, (gu, dn) in BUNDLE_PLAN.items():
        for e in range(4):
            for p, f in (("gate_proj", gu[e]), ("up_proj", gu[e]), ("down_proj", dn[e])):
                want[EXPERT_KEY.format(i=i, e=e, p=p)] = f
    layers = {r["key"]: r["format"] for r in report["layers"]}
    assert layers == {k: f for k, f in want.items() if f != "none"}
    residual = {k for k, _ in read_items(out / spec.RESIDUAL)}
    kept = {k + ".weight" for k, f in want.items() if f == "none"}
    assert kept and kept <= residual
    assert not any(".experts.gate_proj" in k or ".experts.down_proj" in k for k in set(layers) | residual)


def _drop_layer(b, key):
    """Remove layer ``key`` from its shard and from the report's layer table: a consistent bundle without it."""
    r = json.loads((b / spec.REPORT).read_text())
    shard = next(x["shard"] for x in r["layers"] if x["key"] == key)
    r["layers"] = [x for x in r["layers"] if x["key"] != key]
    for s in r["shards"]:
        s["layers"] -= s["file"] == shard
    (b / spec.REPORT).write_text(json.dumps(r))
    rewrite(b, shard, lambda items: [(k, a) for k, a in items if not k.startswith(key + ".")])


def _drop_residual(b, key):
    rewrite(b, spec.RESIDUAL, lambda items: [(k, a) for k, a in items if k != key + ".weight"])


# (layer, expert, projection, how it is stored): one expert's part removed
MISSING = [(1, 2, "gate_proj", _drop_layer), (0, 1, "down_proj", _drop_layer), (1, 3, "up_proj", _drop_residual),
           (0, 0, "gate_proj", _drop_layer), (1, 0, "down_proj", _drop_layer)]


@pytest.mark.parametrize("layer,expert,proj,drop", MISSING, ids=[f"{i}.{e}.{p}" for i, e, p, _ in MISSING])
def test_bundle_missing_one_expert_is_refused_naming_it(bundle, tmp_path, layer, expert, proj, drop):
    _, _, out, _ = bundle
    b = tmp_path / "b"
    shutil.copytree(out, b)
    key = EXPERT_KEY.format(i=layer, e=expert, p=proj)
    drop(b, key)
    with pytest.raises(UQFFError, match=rf"expert {expert} of .* is missing: no layer {key.replace('.', '[.]')} "):
        load_bundle(b)


def test_gguf_export_refuses_mixed_experts(bundle, tmp_path):
    pytest.importorskip("gguf")
    from toolkit.gguf.export import export_gguf

    ckpt, policy, _, _ = bundle
    with pytest.raises(FormatError, match=r"layer 0: its experts are stored at mixed widths \(.*\).*save a UQFF bundle"):
        export_gguf(ckpt, tmp_path / "x.gguf", policy)
    assert not (tmp_path / "x.gguf").exists()
