"""``moqe warmup`` compiles everything real models then use: after it, nothing compiles again, whether the
weights come from an fp16 checkpoint (copies), an f32 checkpoint (read-only memory maps) or a UQFF bundle,
for every format and KV cache type the app offers. And the CLI says when it compiles and leaves it out of
the rates it prints."""
from __future__ import annotations

import json

import numpy as np
import pytest

import tiny_model
from toolkit.cli import main
from toolkit.model import SamplingParams, generate_tokens
from toolkit.load import load_model
from toolkit.quant import parse_policy
from toolkit.uqff import save_bundle
from toolkit.warmup import FAMILIES_ALL, KV_ALL, compile_watch, warm

BUNDLED = tiny_model.Path(__file__).resolve().parents[1] / "data" / "model"


@pytest.fixture(scope="module")
def warmed():
    return warm(FAMILIES_ALL, KV_ALL, activations=("int8", "f32"))  # both kinds: the tests run both


def _generate(model, kv, n=3, prompt_len=40):
    m = __import__("copy").copy(model)
    m.kv_types = (kv, kv)
    ids = list(np.arange(prompt_len) % model.cfg.vocab_size)
    return [e.token for e in generate_tokens(m, [ids], SamplingParams(max_new_tokens=n))]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    # float32 tensors (the loader hands out read-only memory maps), head dim 32 (the GGML KV caches need it)
    f32 = tiny_model.write(d / "f32", cfg=dict(tiny_model.CONFIG, num_attention_heads=2, num_key_value_heads=1))
    (f32 / "tokenizer.json").write_bytes((BUNDLED / "tokenizer.json").read_bytes())
    bundle = d / "bundle"
    save_bundle(f32, bundle, parse_policy("moqe", "int3"))
    return {"fp16 checkpoint": BUNDLED, "f32 checkpoint": f32, "bundle": bundle}


@pytest.mark.parametrize("fmt,act", [(f, "f32") for f in (None, "int8", "fp8", "int4", "int3", "int2", "q8_0", "q4_0", "mxfp4")]
                         + [(f, "int8") for f in ("int8", "int4", "int3", "int2", "q8_0", "q4_0")])
def test_nothing_compiles_after_warmup(warmed, sources, fmt, act, monkeypatch):
    from toolkit.cpu import moe_gemm

    monkeypatch.setattr(moe_gemm, "DEFAULT_ACTIVATIONS", act)
    with compile_watch() as w:
        for name, src in sources.items():
            if name == "bundle" and fmt is not None:
                continue  # a bundle runs as written
            for preset in (("moqe", "all-linear") if fmt else ("none",)):
                model, _ = load_model(src, policy=parse_policy(preset, fmt))
                for kv in KV_ALL:
                    _generate(model, kv)
    assert w.count == 0, f"{w.count} kernel(s) compiled after the warm-up ({w.seconds:.1f} s)"


def test_a_second_warmup_loads_everything_from_the_cache(warmed):
    again = warm(("int4",), ("q8_0",))
    assert again.compiled == 0 and all(s.compiled == 0 for s in again.steps)


def test_parallel_warmup_runs_every_step_then_checks_it_here(warmed):
    """``jobs=2``: the core step here, the others shared out to two worker processes, then each once more here,
    loading from the cache: nothing compiles in that pass (the GGML codecs' row loops are cached per format now,
    no longer one closure the formats overwrote in Numba's index)."""
    serial = warm(("int4", "q8_0"), ("q8_0",), policies=("moqe",))
    parallel = warm(("int4", "q8_0"), ("q8_0",), policies=("moqe",), jobs=2)
    labels = [s.what for s in serial.steps]
    assert [s.what for s in parallel.steps[:1]] == labels[:1]
    assert sorted(s.what for s in parallel.steps[1:len(labels)]) == sorted(labels[1:])  # the workers' steps
    assert [s.what for s in parallel.steps[len(labels):]] == labels[1:]  # the check pass, in order
    assert all(s.compiled == 0 for s in parallel.steps[len(labels):])


def test_watch_counts_a_real_compilation():
    from numba import njit

    with compile_watch() as w:
        njit(lambda x: x + 1)(1)  # a fresh function: always compiled
    assert w.count == 1 and w.seconds > 0


def test_cli_rates_leave_compilation_out_and_never_print_zero(capsys, warmed):
    assert main(["generate", "--prompt", "It is", "--max-new-tokens", "3", "--experts", "int4"]) == 0
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("[prefill")][-1]
    assert "tok/s" in line and " 0.0 tok/s" not in line and "ms" in line and "compiling" not in line


def test_cli_decodes_on_the_compiled_step_and_says_so(capsys, warmed):
    """The path a user gets is the one the benchmarks measure: a plain `moqe generate` (any warmed format and
    KV cache) runs the compiled decode step, and --verbose says so."""
    for fmt, kv in (("q4_0", "q8_0"), ("int4", "q4_0"), ("int8", "f32")):
        assert main(["generate", "--prompt", "It is", "--max-new-tokens", "4", "--experts", fmt, "--kv-cache", kv,
                     "--verbose", "--threads", "1"]) == 0
        err = capsys.readouterr().err
        assert "[decode path: the compiled decode step (" in err, (fmt, kv, err[-500:])
        assert "compiling" not in err, (fmt, kv, err[-500:])  # warmed: nothing compiled


def test_warmup_covers_every_format_and_cache_decode_step():
    from toolkit.warmup import POLICIES, warm_steps

    steps = warm_steps(FAMILIES_ALL, KV_ALL, POLICIES)
    decode = {name for kind, name in steps if kind == "decode"}
    assert decode == {f"moqe:{f}:{kv}" for f in FAMILIES_ALL for kv in KV_ALL if kv != "f32"}
    assert not [s for s in warm_steps(FAMILIES_ALL, KV_ALL, POLICIES, decode=False) if s[0] == "decode"]


def test_group_size_chosen_and_named(tmp_path, capsys):
    cfg = dict(tiny_model.CONFIG, intermediate_size=96)  # 96: 64 and 128 do not divide it, 32 does
    d = tiny_model.write(tmp_path / "m", cfg=cfg)
    (d / "tokenizer.json").write_bytes((BUNDLED / "tokenizer.json").read_bytes())
    assert main(["quantize", "--model", str(d), "--experts", "int3"]) == 0
    err = capsys.readouterr().err
    assert "int3: using int3-g32 (the default group size 64 does not divide the expert intermediate size 96" in err
    assert main(["quantize", "--model", str(d), "--experts", "int3-g64"]) == 2
    assert "not divisible by the group size 64 of format 'int3-g64'; use int3-g32" in capsys.readouterr().err
    assert main(["quantize", "--model", str(d), "--experts", "q4_0"]) == 0  # no group sizes to pick: untouched
    json.loads((d / "config.json").read_text())  # the source is untouched


@pytest.mark.activations("int8")
def test_cli_default_runs_int8_experts_on_the_compiled_step(capsys, warmed):
    """The default a user gets (int8 activations for the integer formats) decodes on the compiled step with the
    integer kernels, warmed by the default warm-up, and --verbose says both."""
    for fmt, kv in (("q4_0", "q8_0"), ("int4", "f32"), ("q8_0", "q4_0")):
        assert main(["generate", "--prompt", "It is", "--max-new-tokens", "4", "--experts", fmt, "--kv-cache", kv,
                     "--verbose", "--threads", "1"]) == 0
        err = capsys.readouterr().err
        assert "[decode path: the compiled decode step (" in err, (fmt, kv, err[-500:])
        assert "expert activations int8 (integer kernels)" in err, (fmt, kv, err[-500:])
        assert "compiling" not in err, (fmt, kv, err[-500:])


def test_the_library_default_is_int8_activations():
    """A fresh process (no test fixture pinning the kind) runs the integer formats on int8 activations."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from toolkit.model.runtime import Runtime; print(Runtime(\"numba\").activations)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "int8"


def test_emulator_builds_count_as_compilation(tmp_path, monkeypatch):
    """``--backend cuda-emu``'s g++ build of a kernel source is compilation, as Numba's is: the CLI says so once
    and leaves it out of the rates it prints (a cache hit is not counted)."""
    from toolkit.gpu import add, emulate

    monkeypatch.setenv("MOQE_EMU_CACHE", str(tmp_path))
    cu = emulate.EMU_DIR.parent / f"{add.SOURCE}.cu"
    said = []
    with compile_watch(on_first=lambda: said.append("compiling")) as w:
        emulate.build(cu, tuple(add.KERNELS))
    assert w.count == 1 and w.seconds > 0.05 and said == ["compiling"]
    with compile_watch() as again:
        emulate.build(cu, tuple(add.KERNELS))
    assert again.count == 0 and not emulate.WATCHERS
