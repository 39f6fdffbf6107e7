"""Routed experts placed on the device or on the host (``toolkit/model/placement.py``, ``hybrid_experts`` in
``toolkit/model/moe.py``), proven on the emulated device (``cuda-emu``), where every byte across the bus is counted.

- Placements as tables: ``--cpu-moe``, ``--n-cpu-moe N`` (llama.cpp's meaning: layers 0..N-1), a placement file;
  every refusal (a bad line, a layer or expert the model lacks, a line twice, two flags at once, a device placement
  on a CPU backend) before any weight is read.
- Logits of every placement (all on the device, all on the host, the first layer on the host, a per-expert file,
  mixed formats on both sides) equal the NumPy backend's within ``TOL``, prefill of a batch of two prompts of
  different lengths and decode steps after it. The families' own parts (Qwen3-MoE, DeepSeek-V3, gpt-oss) are
  tested the same way in tests/test_parity_hf.py.
- Bytes across the bus per decode step equal ``layer_bus_bytes`` summed over the layers with host experts (the
  routing out, the rows routed to a host expert out and back, their indices in) plus the token ids: nothing
  else, so no weight byte crosses after load.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import tiny_model
from helpers import assert_close
from test_cuda_model import PROMPTS, _batch  # two prompts of different lengths (B = 2)
from test_mixed_experts import PLAN, plan_lines
from toolkit.cli import main
from toolkit.errors import ToolkitError
from toolkit.formats.mixed import MixedExperts
from toolkit.load import load_model
from toolkit.model import Checkpoint, MoEModel, load_config, load_weights
from toolkit.model.placement import PlacementSpec, Places, layer_bus_bytes, parse_placement, resolve_places
from toolkit.quant import parse_policy, quantizing_transform, trace
from toolkit.quant.plan import plan_policy, write_plan

TOL = dict(atol=5e-5, rtol=5e-5)  # f32 on both sides (host activations f32); kernels sum in another order than NumPy
INT8_TOL = dict(atol=5e-2, rtol=5e-2)  # the host's int8 activations (the default): a code of 8-bit blocks per row
CFG = dict(tiny_model.CONFIG, num_attention_heads=2, num_key_value_heads=1, num_local_experts=6)  # head dim 32


def _cfg(L=3, E=4, moe=(False, True, True)):
    return SimpleNamespace(num_layers=L, num_experts=E, moe_layers=list(moe))


# ---- what the user says -> the host mask [L, E] ------------------------------------------------------------------
MASKS = [
    (PlacementSpec(cpu_moe=True), [[0] * 4, [1] * 4, [1] * 4]),
    (PlacementSpec(n_cpu_moe=1), None),  # layer 0 is dense: nothing to move, nothing on the host
    (PlacementSpec(n_cpu_moe=2), [[0] * 4, [1] * 4, [0] * 4]),
    (PlacementSpec(n_cpu_moe=9), [[0] * 4, [1] * 4, [1] * 4]),
    (PlacementSpec(n_cpu_moe=0), None),
    ("layers.2.experts=host\nlayers.2.experts.1=device  # one taken back\nlayers.1.experts.3=host\n",
     [[0] * 4, [0, 0, 0, 1], [1, 0, 1, 1]]),
    ("layers.1.experts.0=device\n# nothing on the host\n", None),
]


@pytest.mark.parametrize("spec,want", MASKS, ids=[f"mask{i}" for i in range(len(MASKS))])
def test_placement_resolves_to_a_host_mask(tmp_path, spec, want):
    if isinstance(spec, str):
        (tmp_path / "p.txt").write_text(spec)
        spec = PlacementSpec(file=str(tmp_path / "p.txt"))
    places = resolve_places(spec, _cfg(), "cuda-emu")
    if want is None:
        assert places is None
    else:
        np.testing.assert_array_equal(places.host, np.array(want, bool))
        assert places.layer(0) is None and places.label == spec.label


BAD_FILES = [
    ("layers.1.experts=gpu\n", r"p\.txt, line 1: 'layers\.1\.experts=gpu' must look like"),
    ("layers.1.expert.0=host\n", r"line 1: .* must look like layers\.I\.experts=host"),
    ("\nlayers.0.experts=host\n", r"p\.txt, line 2: the model has no MoE layer 0 \(MoE layers: 1\.\.2\)"),
    ("layers.7.experts.0=host\n", r"line 1: the model has no MoE layer 7"),
    ("layers.1.experts.4=host\n", r"line 1: the model has 4 experts per layer \(0\.\.3\); no expert 4"),
    ("layers.1.experts.2=host\nlayers.1.experts.2=device\n", r"line 2: layers\.1\.experts\.2 is already placed on line 1"),
]


@pytest.mark.parametrize("text,message", BAD_FILES, ids=[f"bad{i}" for i in range(len(BAD_FILES))])
def test_a_bad_placement_file_is_refused_naming_the_line(tmp_path, text, message):
    (tmp_path / "p.txt").write_text(text)
    with pytest.raises(ToolkitError, match=message):
        resolve_places(PlacementSpec(file=str(tmp_path / "p.txt")), _cfg(), "cuda-emu")


def test_two_placement_flags_and_a_negative_count_are_refused():
    with pytest.raises(ToolkitError, match=r"--cpu-moe and --n-cpu-moe each say where the experts live; give one"):
        PlacementSpec(cpu_moe=True, n_cpu_moe=1)
    with pytest.raises(ToolkitError, match=r"--n-cpu-moe must be >= 0, got -1"):
        PlacementSpec(n_cpu_moe=-1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_uqff_support import _with_tokenizer

    d = tiny_model.write(tmp_path_factory.mktemp("placement") / "m", cfg=CFG)
    _with_tokenizer(d)
    return d


@pytest.mark.parametrize("backend,spec,message", [
    ("numba", PlacementSpec(n_cpu_moe=1), r"--n-cpu-moe 1 places 6 routed expert\(s\) on the device, and --backend numba has none"),
    ("numpy", PlacementSpec(), None),
    ("numba", PlacementSpec(cpu_moe=True), None),  # every expert on the host already: nothing to do
])
def test_a_device_placement_on_a_cpu_backend_is_refused_before_any_weight_is_read(ckpt, monkeypatch, backend, spec, message):
    import toolkit.sources

    read = []
    monkeypatch.setattr(toolkit.sources, "load_weights", lambda *a, **k: read.append(1) or (_ for _ in ()).throw(RuntimeError("read")))
    if message is None:
        with pytest.raises(RuntimeError, match="read"):  # accepted: the load went on to the weights
            load_model(ckpt, backend, placement=spec)
        return
    with pytest.raises(ToolkitError, match=message):
        load_model(ckpt, backend, placement=spec)
    assert not read


def test_a_bad_placement_file_stops_the_load_before_any_weight_is_read(ckpt, tmp_path, monkeypatch):
    import toolkit.sources

    monkeypatch.setattr(toolkit.sources, "load_weights", lambda *a, **k: pytest.fail("a weight was read"))
    (tmp_path / "p.txt").write_text("layers.0.experts.6=host\n")
    with pytest.raises(ToolkitError, match=r"the model has 6 experts per layer \(0\.\.5\); no expert 6"):
        load_model(ckpt, "cuda-emu", placement=PlacementSpec(file=str(tmp_path / "p.txt")))


# ---- logits: every placement against the NumPy backend -----------------------------------------------------------
def _weights(ckpt, fmt):
    cfg = load_config(ckpt)
    if fmt == "plan":  # mixed formats: three per side in layer 0, an f32 expert among int4 ones in layer 1
        path = ckpt.parent / "mix.plan"
        write_plan(path, plan_lines(PLAN), ["test plan"])
        policy = plan_policy(path, cfg)
    else:
        policy, _ = parse_policy("moqe" if fmt else "none", fmt).fit(cfg)
    return cfg, load_weights(Checkpoint(ckpt), cfg, quantizing_transform(policy, "numba"))


def _reference(cfg, w):
    """The NumPy backend on the same (quantized) weights, mixed experts dequantized as the kernels read them."""
    deq = lambda x: x.dequantize("numpy") if isinstance(x, MixedExperts) else x  # noqa: E731
    return MoEModel(cfg, dataclasses.replace(w, layers=[dataclasses.replace(lw, moe={k: deq(v) for k, v in lw.moe.items()})
                                                           for lw in w.layers]), "numpy")


E6 = np.arange(6)
PLACEMENTS = {  # name -> host mask [L, E] (None: all on the device)
    "device": None,
    "cpu-moe": np.ones((2, 6), bool),
    "n-cpu-moe-1": np.array([[True] * 6, [False] * 6]),
    "per-expert": np.array([E6 % 2 == 0, E6 >= 4]),  # both layers split, on different experts
}
CASES = [(p, f) for p in PLACEMENTS for f in (None, "int4", "q4_0")] + [(p, "plan") for p in ("per-expert", "cpu-moe")]


@pytest.mark.parametrize("place,fmt", CASES, ids=[f"{p}-{f or 'f32'}" for p, f in CASES])
def test_every_placement_gives_the_numpy_logits(ckpt, place, fmt):
    cfg, w = _weights(ckpt, fmt)
    host = PLACEMENTS[place]
    places = None if host is None else Places(host, place)
    ref, dm = _reference(cfg, w), MoEModel(cfg, w, "cuda-emu", activations="f32" if host is not None else None, places=places)
    if host is not None:
        assert [getattr(l.ffn.experts, "host", None) is not None for l in dm.layers] == [bool(h.any()) for h in host]
        assert dm.weight_bytes()["host experts"] > 0
    tokens, lens = _batch()
    c_ref, c_dm = ref.new_cache(2, 16), dm.new_cache(2, 16)
    want = ref.forward(tokens, c_ref, lengths=lens)  # [B, T, V]: every row's logits
    got = dm.rt.host(dm.forward(tokens, c_dm, lengths=lens))
    for b, n in enumerate(lens):
        assert_close(got[b, :n], want[b, :n], **TOL, what=f"prefill, sequence {b}")
    for step in range(3):
        nxt = np.array([5 + step, 9 + step])
        assert_close(dm.rt.host(dm.decode(nxt, c_dm)), ref.decode(nxt, c_ref), **TOL, what=f"decode step {step}")


@pytest.mark.activations("int8")  # the library's default, as a user gets it
def test_host_experts_take_int8_activations_by_default(ckpt):
    """The host's default (int8 activations, as on the numba backend): close to NumPy within 8-bit blocks' rounding,
    and not the same bits as the f32 path (the int8 kernels did run)."""
    cfg, w = _weights(ckpt, "int4")
    ref, places = _reference(cfg, w), Places(np.ones((2, 6), bool), "cpu-moe")
    outs = {}
    for act in (None, "f32"):
        dm = MoEModel(cfg, w, "cuda-emu", activations=act, places=places)
        assert dm.rt.host_rt.activations == (act or "int8")
        tokens, lens = _batch()
        outs[act] = dm.rt.host(dm.forward(tokens, dm.new_cache(2, 16), lengths=lens, last_only=True))
    want = ref.forward(tokens, ref.new_cache(2, 16), lengths=lens, last_only=True)
    assert_close(outs[None], want, **INT8_TOL, what="int8 host activations")
    assert_close(outs["f32"], want, **TOL, what="f32 host activations")
    assert not np.array_equal(outs[None], outs["f32"])


# ---- the bus: exactly the formula, no weight byte ---------------------------------------------------------------
@pytest.mark.parametrize("place", ["cpu-moe", "n-cpu-moe-1", "per-expert"])
@pytest.mark.parametrize("B", [1, 2])
def test_bytes_across_the_bus_per_decode_step_are_the_formula(ckpt, place, B):
    cfg, w = _weights(ckpt, "int4")
    host = PLACEMENTS[place]
    dm = MoEModel(cfg, w, "cuda-emu", activations="f32", places=Places(host, place))
    dev, rt = dm.rt.device, dm.rt
    cache = dm.new_cache(B, 16)
    dm.forward(np.array(PROMPTS[0][:4] * B).reshape(B, 4), cache)
    dm.decode(np.arange(B) + 3, cache)  # the device's constants of this batch shape are built once per process
    routed, spent = {}, []

    def see(i, x, ids, wts):  # the test's own read of the routing, taken out of the count below
        before = dev.counters.snapshot()
        routed[i] = rt.host(ids)
        spent.append(dev.counters.since(before))

    with trace.watching_experts(dm, see):
        before = dev.counters.snapshot()
        dm.decode(np.arange(B) + 5, cache)
        moved = dev.counters.since(before)
    want_in, want_out = 4 * B, 0  # the token ids in
    for i, ids in routed.items():
        if host[i].any():
            n = int(host[i][ids].any(1).sum())  # tokens routed to a host expert
            per = layer_bus_bytes(B, n, cfg.hidden_size, cfg.top_k)
            want_in, want_out = want_in + per["in"], want_out + per["out"]
    assert moved.bytes_in - sum(s.bytes_in for s in spent) == want_in
    assert moved.bytes_out - sum(s.bytes_out for s in spent) == want_out
    assert want_out > 0


def test_all_on_the_device_copies_in_the_token_ids_only(ckpt):
    cfg, w = _weights(ckpt, "int4")
    dm = MoEModel(cfg, w, "cuda-emu")
    cache = dm.new_cache(2, 16)
    dm.forward(np.array([[3, 5], [7, 9]]), cache)
    dm.decode(np.array([5, 6]), cache)  # records the step
    before = dm.rt.device.counters.snapshot()
    dm.decode(np.array([7, 8]), cache)
    moved = dm.rt.device.counters.since(before)
    assert (moved.bytes_in, moved.bytes_out) == (8, 0)


# ---- the command line --------------------------------------------------------------------------------------------
def test_generate_on_the_emulated_device_with_cpu_moe_says_where_the_bytes_are(capsys):
    """The bundled model: ``--cpu-moe`` on the emulated device prints its placement line (the bus measured per
    decode step) and generates the same greedy text as the numba backend."""
    argv = ["generate", "--prompt", "Once upon a time", "--max-new-tokens", "4", "--ignore-eos", "--temperature", "0"]
    assert main(argv + ["--backend", "cuda-emu", "--experts", "int4", "--cpu-moe", "--activations", "f32"]) == 0
    out, err = capsys.readouterr()
    line = next(l for l in err.splitlines() if l.startswith("[placement --cpu-moe"))
    assert "routed experts 0.0 MB on the device" in line and "bus per decode step, measured: in " in line
    assert main(argv + ["--backend", "numba", "--experts", "int4", "--activations", "f32"]) == 0
    assert capsys.readouterr().out == out  # the same greedy text as the CPU backend


def test_cli_refuses_a_device_placement_on_the_cpu_backend_and_two_flags(ckpt, capsys):
    assert main(["generate", "--model", str(ckpt), "--prompt", "a", "--n-cpu-moe", "1"]) == 2
    assert "--n-cpu-moe 1 places 6 routed expert(s) on the device, and --backend numba has none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(ckpt), "--prompt", "a", "--cpu-moe", "--n-cpu-moe", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


def _table(out: str, title: str) -> list[dict]:
    """The rows of the markdown table printed under ``title``."""
    lines = out[out.index(title):].splitlines()[1:]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for l in lines[2:]:
        if not l.startswith("|"):
            break
        rows.append(dict(zip(head, (c.strip() for c in l.strip("|").split("|")))))
    return rows


def test_info_prints_bytes_per_side_and_the_bus_per_token(ckpt, capsys):
    from toolkit.formats import get_format

    assert main(["info", "--model", str(ckpt), "--n-cpu-moe", "1", "--experts", "int4,q4_0"]) == 0
    rows = _table(capsys.readouterr().out, "placement --n-cpu-moe 1 on a device")
    D, I, A = CFG["hidden_size"], CFG["intermediate_size"], CFG["num_experts_per_tok"]
    one = 2 * D * 4 + 2 * A * 4 + 4  # a token routed to a host expert in one layer: its row both ways, routing, index
    assert [r["format"] for r in rows] == ["int4-g64", "q4_0"]
    for r in rows:
        f = get_format(r["format"])
        assert (r["experts on the device"], r["experts on the host"]) == ("6", "6")
        assert int(r["device bytes"]) == 6 * (f.nbytes((2 * I, D)) + f.nbytes((D, I)))
        assert int(r["bus bytes per token (at most)"]) == one
        # 6 of 6 experts of layer 0 on the host: every token touches one
        assert int(r["bus bytes per token (uniform routing)"]) == one


# ---- every load path keeps a placement's experts on the host as they arrive --------------------------------------
@pytest.mark.parametrize("source", ["checkpoint", "bundle", "gguf"])
def test_every_load_path_places_experts_and_gives_the_numpy_logits(ckpt, tmp_path, source):
    """A checkpoint quantized at load, a UQFF bundle and a GGUF file, each loaded on the emulated device with a
    per-expert placement file: the host experts never go up (the layer's bytes on the host are the placed experts'),
    and the logits equal the NumPy backend's on the same file."""
    policy = parse_policy("moqe", "q4_0")
    path = ckpt
    if source == "bundle":
        from toolkit.uqff import save_bundle

        save_bundle(ckpt, tmp_path / "b", policy)
        path, policy = tmp_path / "b", None
    elif source == "gguf":
        from toolkit.gguf.export import export_gguf

        export_gguf(ckpt, tmp_path / "m.gguf", policy)
        path, policy = tmp_path / "m.gguf", None
    (tmp_path / "p.txt").write_text("layers.0.experts=host\nlayers.1.experts.1=host\nlayers.1.experts.4=host\n")
    spec = PlacementSpec(file=str(tmp_path / "p.txt"))
    ref, _ = load_model(path, "numpy", policy=policy)
    dm, _ = load_model(path, "cuda-emu", policy=policy, placement=spec, activations="f32")
    np.testing.assert_array_equal(dm.layers[1].ffn.experts.host, np.isin(E6, [1, 4]))
    wb = dm.weight_bytes()
    assert wb["host experts"] == pytest.approx(wb["experts"] * (6 + 2) / 12, rel=0.02)  # q4_0 throughout, 8 of 12
    tokens, lens = _batch()
    want = ref.forward(tokens, ref.new_cache(2, 16), lengths=lens, last_only=True)
    assert_close(dm.rt.host(dm.forward(tokens, dm.new_cache(2, 16), lengths=lens, last_only=True)), want, **TOL)


@pytest.fixture(scope="module")
def qk_norm_models(tmp_path_factory):
    from test_uqff_support import OLMOE, QWEN3_MOE, tiny_qk_norm_moe

    d = tmp_path_factory.mktemp("qk")
    return {"qwen3": tiny_qk_norm_moe(d / "qwen3", QWEN3_MOE), "olmoe": tiny_qk_norm_moe(d / "olmoe", OLMOE)}


@pytest.mark.parametrize("arch", ["qwen3", "olmoe"])
@pytest.mark.parametrize("fmt", [None, "int4"])
def test_qwen3_and_olmoe_with_experts_split_give_the_numpy_logits(qk_norm_models, arch, fmt):
    """Qwen3-MoE (per-head q/k norms, a dense layer) and OLMoE (norms over the projection, clip_qkv), every MoE
    layer's experts split: the even ones on the host."""
    d = qk_norm_models[arch]
    cfg = load_config(d)
    policy, _ = parse_policy("moqe" if fmt else "none", fmt).fit(cfg)
    w = load_weights(Checkpoint(d), cfg, quantizing_transform(policy, "numba"))
    host = np.array([[bool(cfg.moe_layers[i]) and e % 2 == 0 for e in range(cfg.num_experts)] for i in range(cfg.num_layers)])
    ref, dm = MoEModel(cfg, w, "numpy"), MoEModel(cfg, w, "cuda-emu", activations="f32", places=Places(host, "even"))
    assert sum(getattr(l.ffn, "experts", None) is not None and hasattr(l.ffn.experts, "host") for l in dm.layers) == sum(cfg.moe_layers)
    tokens, lens = _batch()
    c_ref, c_dm = ref.new_cache(2, 16), dm.new_cache(2, 16)
    want = ref.forward(tokens, c_ref, lengths=lens, last_only=True)
    assert_close(dm.rt.host(dm.forward(tokens, c_dm, lengths=lens, last_only=True)), want, **TOL, what="prefill")
    for step in range(2):
        nxt = np.array([5 + step, 9 + step])
        assert_close(dm.rt.host(dm.decode(nxt, c_dm)), ref.decode(nxt, c_ref), **TOL, what=f"decode step {step}")


def test_the_gpu_checks_placement_step_runs_on_the_emulated_device(capsys):
    """``.ci/gpu-check``'s placement step (skipped in the budgeted emulated flow): every placement's run and the
    placement bench, on cuda-emu with tiny shapes; the bench's bus bytes are the formula's."""
    from toolkit.bench.gpu_check import inner_placement

    assert inner_placement(emulate=True) == 0
    out = capsys.readouterr().out
    assert "| all on the device |" in out and "| --n-cpu-moe 2 |" in out and "| --cpu-moe |" in out
    table = _table(out, "one token through a layer of D 256")
    assert table and table[0]["bus in / out B"] == table[0]["formula in / out B"]
    assert "| --cpu-moe | - |" not in out  # the run's rate was read
