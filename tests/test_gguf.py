"""GGUF out and in (toolkit/gguf): the bundled Mixtral exported in llama.cpp's names and GGML types, read back
with identical logits; the blocks equal the ``gguf`` package's quantizer; q/k rows in GGML's rope order;
llama.cpp itself loads the export where a build is given (``MOQE_LLAMA_CPP=DIR``); bad files and refused
exports name what is wrong and leave nothing behind."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from toolkit.errors import ModelError
from toolkit.gguf.export import export_gguf
from toolkit.load import load_model
from toolkit.model import Checkpoint, SamplingParams, generate_tokens
from toolkit.quant import parse_policy

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "data" / "model"
PROMPT = "It is a truth universally acknowledged, that a single man"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """experts format (None: plain) -> the exported file."""
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for fmt in (None, "q8_0", "q4_0"):
        out[fmt] = d / f"model-{fmt or 'f16'}.gguf"
        export_gguf(MODEL, out[fmt], parse_policy("moqe", fmt) if fmt else None)
    return out


@pytest.mark.parametrize("fmt, want, message", [
    ("q4_0", "q4_0", None),
    ("q8_0", "q8_0", None),
    ("q8_0", "q4_0", r"expert tensor\(s\) are not Q4_0, e\.g\. blk\.\d+\.ffn_\w+_exps\.weight is Q8_0"),
    (None, "q4_0", r"are not Q4_0, e\.g\. .* is F16: llama-quantize did not quantize the experts as asked"),
])
def test_anchor_checks_the_expert_types_it_reads_back(exports, fmt, want, message):
    """The llama.cpp anchor's read-back check (bench anchors / bench layer): a file whose routed experts are not
    all in the row's format is refused, naming a tensor (the old anchor timed f32 experts as "q4_0")."""
    from toolkit.bench.anchors import check_experts

    if message is None:
        counts = check_experts(exports[fmt], want)
        assert counts[want.upper()] > 0 and set(counts) <= {want.upper(), "F32", "F16", "BF16"}
    else:
        with pytest.raises(RuntimeError, match=message):
            check_experts(exports[fmt], want)


def test_anchor_checks_the_attention_type_it_reads_back(exports):
    """With ``dense``, the anchor's file must hold attention's projections in the type ours reads them in."""
    from toolkit.bench.anchors import check_experts, gguf_types

    held = {t for n, t in gguf_types(exports["q4_0"]).items() if ".attn_output." in n}
    assert len(held) == 1
    held = held.pop()
    assert check_experts(exports["q4_0"], "q4_0", held.lower())["Q4_0"] > 0
    wrong = "F32" if held != "F32" else "F16"
    with pytest.raises(RuntimeError, match=rf"blk\.\d+\.attn_\w+\.weight is {held}, not {wrong} as ours holds attention"):
        check_experts(exports["q4_0"], "q4_0", wrong.lower())


def test_anchor_refuses_other_quantized_matrices(tmp_path):
    from toolkit.bench.anchors import check_experts

    out = tmp_path / "all.gguf"
    export_gguf(MODEL, out, parse_policy("all-linear", "q8_0"))
    with pytest.raises(RuntimeError, match=r"blk\.\d+\.attn_\w+\.weight is Q8_0; only the routed experts should be quantized"):
        check_experts(out, "q8_0")


def _logits(model, ids):
    cache = model.new_cache(1, ids.shape[1] + 4)
    pre = model.forward(ids, cache)[0]
    steps = [model.forward(np.array([[t]]), cache)[0, 0] for t in (5, 9, 13, 17)]
    return np.concatenate([pre, np.stack(steps)])


@pytest.mark.parametrize("fmt", [None, "q8_0", "q4_0"])
def test_export_reads_back_with_identical_logits_and_text(exports, fmt):
    ours, tok = load_model(MODEL, policy=parse_policy("moqe", fmt) if fmt else None)
    back, tok2 = load_model(exports[fmt])
    ids = np.array([tok.encode(PROMPT)])
    assert tok2.encode(PROMPT) == list(ids[0])
    assert np.array_equal(_logits(back, ids), _logits(ours, ids))
    if fmt:
        assert back.layers[0].ffn.expert_weights[0].fmt.name == fmt  # kept as stored, not requantized
    params = SamplingParams(max_new_tokens=12)
    a = [e.token for e in generate_tokens(ours, [list(ids[0])], params)]
    b = [e.token for e in generate_tokens(back, [list(ids[0])], params)]
    assert a == b


@pytest.mark.parametrize("fmt,gtype", [("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_exported_blocks_equal_the_gguf_quantizer(exports, fmt, gtype):
    ck = Checkpoint(MODEL)
    t = {x.name: x for x in gguf.GGUFReader(exports[fmt]).tensors}
    qt = getattr(gguf.GGMLQuantizationType, gtype)
    for name, hf in (("blk.0.ffn_gate_exps.weight", "w1"), ("blk.3.ffn_up_exps.weight", "w3"),
                     ("blk.1.ffn_down_exps.weight", "w2")):
        assert t[name].tensor_type == qt
        for e in (0, 5):
            w = ck.get_f32(f"model.layers.{name.split('.')[1]}.block_sparse_moe.experts.{e}.{hf}.weight")
            assert np.array_equal(np.asarray(t[name].data)[e].reshape(-1), gguf.quants.quantize(w, qt).reshape(-1))


def test_q_and_k_rows_are_in_ggml_rope_order(exports):
    """llama.cpp's converter permutes q/k rows per head from halves to adjacent pairs."""
    ck = Checkpoint(MODEL)
    t = {x.name: x for x in gguf.GGUFReader(exports[None]).tensors}
    for name, hf, heads in (("blk.2.attn_q.weight", "q_proj", 8), ("blk.2.attn_k.weight", "k_proj", 2)):
        w = ck.get_f32(f"model.layers.2.self_attn.{hf}.weight")
        want = w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)
        assert np.array_equal(np.asarray(t[name].data, np.float32), want)


def _completion_exe() -> Path:
    """llama.cpp's ``llama-completion`` under ``$MOQE_LLAMA_CPP`` (itself, bin/ or build/bin/); skips without one."""
    root = os.environ.get("MOQE_LLAMA_CPP")
    exe = next((p for p in ([Path(root) / s / "llama-completion" for s in (".", "bin", "build/bin")] if root else [])
                if p.is_file()), None)
    if exe is None:
        pytest.skip("no llama.cpp build: set MOQE_LLAMA_CPP to a folder holding llama-completion")
    return exe


def test_llama_cpp_runs_the_export_to_the_same_greedy_text(exports):
    """The final judge: llama.cpp's own ``llama-completion`` on our q4_0 export, greedy, against ours."""
    exe = _completion_exe()
    n = 16
    p = subprocess.run([str(exe), "-m", str(exports["q4_0"]), "-p", PROMPT, "-n", str(n), "--temp", "0", "-no-cnv",
                        "--no-warmup", "-t", "1", "--simple-io"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    ours, tok = load_model(exports["q4_0"])
    ids = tok.encode(PROMPT)
    text = tok.decode([e.token for e in generate_tokens(ours, [ids], SamplingParams(max_new_tokens=n))])
    assert text.strip() and text.strip() in p.stdout, (text, p.stdout[-1000:])


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """(checkpoint, q8_0 export) of the bundled model with 8 embedding rows past its tokenizer's 8192 ids."""
    import shutil

    from toolkit.uqff.writer import write_safetensors

    d = tmp_path_factory.mktemp("padded") / "model"
    d.mkdir()
    for f in MODEL.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, d / f.name)
    cfg = json.loads((MODEL / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 8192 + 8}))
    ck = Checkpoint(MODEL)
    pad = lambda a: np.concatenate([a, np.zeros((8, a.shape[1]), a.dtype)])  # noqa: E731
    tables = ("model.embed_tokens.weight", "lm_head.weight")
    write_safetensors(d / "model.safetensors", [(n, pad(np.asarray(ck.get(n))) if n in tables else np.asarray(ck.get(n)))
                                                for n in ck.keys()])
    out = d.parent / "padded.gguf"
    export_gguf(d, out, parse_policy("moqe", "q8_0"))
    return d, out


def test_a_vocabulary_past_the_tokenizer_is_padded_as_the_converter_pads_it(padded):
    """A model with more embedding rows than tokenizer ids (Mixtral's 32000, Qwen3's 151936 over smaller
    tokenizers): the export lists one token per row, "[PAD{i}]" of type UNUSED past the tokenizer's (llama.cpp
    refuses a token_embd with more rows than tokens), and reads back with the checkpoint's logits."""
    d, out = padded
    r = gguf.GGUFReader(out)
    f, types = r.fields["tokenizer.ggml.tokens"], r.fields["tokenizer.ggml.token_type"]
    tokens = [bytes(f.parts[i]).decode() for i in f.data]
    assert len(tokens) == 8200 and tokens[8192:] == [f"[PAD{i}]" for i in range(8192, 8200)]
    assert [int(types.parts[i][0]) for i in types.data[8192:]] == [gguf.TokenType.UNUSED] * 8
    ids = np.array([[1, 17, 300, 5]])
    ours, _ = load_model(out)
    ref, _ = load_model(d, policy=parse_policy("moqe", "q8_0"))
    np.testing.assert_allclose(ours.forward(ids, ours.new_cache(1, 4)), ref.forward(ids, ref.new_cache(1, 4)),
                               rtol=1e-4, atol=1e-4)


def test_llama_cpp_loads_a_vocabulary_past_the_tokenizer(padded):
    exe = _completion_exe()
    p = subprocess.run([str(exe), "-m", str(padded[1]), "-p", PROMPT, "-n", "4", "--temp", "0", "-no-cnv", "--no-warmup",
                        "-t", "1", "--simple-io"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


# ---- refused exports and bad files ----------------------------------------------------------------------
@pytest.mark.parametrize("preset,fmt,message", [("moqe", "int4", "GGUF has no type for"),
                                                ("moqe", "int8", "GGUF has no type for")])
def test_export_refuses_a_format_ggml_lacks_and_leaves_nothing(tmp_path, preset, fmt, message):
    out = tmp_path / "m.gguf"
    with pytest.raises(ModelError, match=message):
        export_gguf(MODEL, out, parse_policy(preset, fmt))
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_folder_as_the_output(tmp_path):
    from toolkit.writes import WriteError

    with pytest.raises(WriteError, match="is a folder"):
        export_gguf(MODEL, tmp_path, None)


def _damaged(exports, tmp_path, how):
    data = bytearray(Path(exports["q4_0"]).read_bytes())
    out = tmp_path / "bad.gguf"
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "arch":
        i = data.find(b"llama", 0, 4096)
        data[i:i + 5] = b"gemma"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("how,message", [("truncated", "not a readable GGUF file|holds .* bytes"),
                                         ("arch", "architecture 'gemma' is not supported")])
def test_damaged_gguf_names_the_problem(exports, tmp_path, how, message):
    with pytest.raises(ModelError, match=message):
        load_model(_damaged(exports, tmp_path, how))


def _with_q6_k(src, dst, name: str, blocks) -> None:
    """Copy GGUF ``src`` to ``dst`` with tensor ``name`` replaced by the q6_K bytes ``blocks(a)`` (``a``: its data)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        a = np.asarray(t.data)
        if t.name == name:
            w.add_tensor(t.name, blocks(a), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        else:
            w.add_tensor(t.name, a, raw_dtype=t.tensor_type if t.tensor_type not in (0, 1) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_q6_k_attention_tensor_stays_as_stored(tmp_path, exports):
    """A k-quant attention tensor (q6_K, as llama.cpp's Q4_K_M writes attn_v) runs as stored, and its blocks decode
    to what gguf's decoder gives."""
    rng = np.random.default_rng(0)
    want = {}

    def blocks(a):
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q6_K]
        q = rng.integers(0, 256, (a.shape[0], a.shape[1] // block, size), dtype=np.uint8)
        q[..., 208:] = np.frombuffer(np.full(q.shape[:2], 0.01, np.float16).tobytes(), np.uint8).reshape(*q.shape[:2], 2)
        want["v"] = gguf.quants.dequantize(q.reshape(-1), gguf.GGMLQuantizationType.Q6_K).reshape(a.shape)
        return q.reshape(a.shape[0], -1)

    _with_q6_k(exports[None], tmp_path / "k.gguf", "blk.0.attn_v.weight", blocks)
    m, _ = load_model(tmp_path / "k.gguf")
    v = m.layers[0].attn.v.weight
    assert v.fmt.name == "q6_k" and np.array_equal(v.dequantize(), want["v"])


def test_a_gguf_from_llama_cpps_converter_matches_the_checkpoint(tmp_path):
    """llama.cpp's own ``convert_hf_to_gguf.py`` (f16) read by us: the same tokens and logits as the checkpoint."""
    from toolkit.bench.anchors import LlamaCpp

    root = os.environ.get("MOQE_LLAMA_CPP")
    ll = LlamaCpp(root) if root else None
    if ll is None or ll.converter is None:
        pytest.skip("no llama.cpp source: set MOQE_LLAMA_CPP to a llama.cpp build inside its source tree")
    pytest.importorskip("torch")  # the converter imports it
    out = tmp_path / "converted.gguf"
    ll.convert(MODEL, out, "f16")
    ours, tok = load_model(MODEL)
    theirs, tok2 = load_model(out)
    text = (ROOT / "data" / "heldout.txt").read_text()[:4000]
    assert tok2.encode(text) == tok.encode(text)
    ids = np.array([tok.encode(PROMPT)])
    assert np.array_equal(_logits(theirs, ids), _logits(ours, ids))


def test_moqe_info_reads_a_gguf_file(exports, capsys):
    from toolkit.cli import main

    assert main(["info", "--model", str(exports["q4_0"])]) == 0
    out = capsys.readouterr().out
    assert "MixtralForCausalLM, 4 layers, hidden 256" in out and "stored as float16" in out
    q4 = next(line for line in out.splitlines() if "Q4_0" in line)
    assert [c.strip() for c in q4.strip("|").split("|")][1:3] == ["12", str(4 * 8 * 3 * 512 * 256)]


# ---- the other families: Qwen2-MoE (shared expert, gate, biases), Qwen3-MoE (head norms), OLMoE (projection norms) --
FAMILIES = {  # name -> (transformers config class, overrides); vocab 8192: the bundled tokenizer's
    "qwen2moe": ("Qwen2MoeConfig", dict(hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                        num_experts=4)),
    "qwen3moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=80, moe_intermediate_size=32, head_dim=32,
                                        num_attention_heads=4, num_key_value_heads=2, num_experts=4, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                                  num_experts=4)),  # llama.cpp's olmoe takes k_norm over all heads: Hkv = H
    # DeepSeek-V3: MLA (q through a low rank), a leading dense layer, a shared expert, sigmoid routing in 2 groups with
    # a selection bias and a routed scale; V2: softmax routing, q in one projection, no groups
    "deepseek-v3": ("DeepseekV3Config", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=2,
                                             topk_group=1, first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=40,
                                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_shared_experts=1,
                                             routed_scaling_factor=2.5, norm_topk_prob=True)),
    "deepseek-v2": ("DeepseekV2Config", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                                             topk_method="greedy", n_group=1, topk_group=1, first_k_dense_replace=1,
                                             kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                             v_head_dim=12, n_shared_experts=2, routed_scaling_factor=1.0)),
    # GLM-4.5: V3's MoE parts with GQA, q/k/v biases, per-head q/k norms, rope on half of each head
    "glm4moe": ("Glm4MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
                                      n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                      attention_bias=True, use_qk_norm=True, routed_scaling_factor=1.5,
                                      norm_topk_prob=True)),
    # gpt-oss: sinks, biases everywhere, a sliding window of 8 on even layers (shorter than the prompt), yarn
    # (factor 1: llama.cpp's rounded correction range and gpt-oss's unrounded one give the same frequencies)
    "gpt-oss": ("GptOssConfig", dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=32, num_local_experts=4, sliding_window=8,
                                     rope_scaling={"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                   "truncate": False, "original_max_position_embeddings": 128})),
}


# config.json keys the hub's checkpoints carry and transformers 5 does not write (llama.cpp's converter reads them:
# without scoring_func it leaves expert_gating_func out, and llama.cpp then runs deepseek2 with softmax gating)
HUB_KEYS = {"deepseek-v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
# llama.cpp's converter for these needs the family's own tokenizer (GLM's: its [gMASK] token), which the offline
# bundled one lacks: their llama.cpp check is llama-completion on our exports only
OWN_TOKENIZER = {"glm4moe"}


def _family_checkpoint(d: Path, name: str, **extra) -> Path:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cls, over = FAMILIES[name]
    cfg = getattr(transformers, cls)(vocab_size=8192, num_hidden_layers=2, num_experts_per_tok=2,
                                     max_position_embeddings=128, initializer_range=0.15, bos_token_id=1,
                                     eos_token_id=2, pad_token_id=0, **{**over, **extra})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(d)
    if name in HUB_KEYS:
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, **HUB_KEYS[name]}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((MODEL / f).read_bytes())
    return d


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    d = _family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    out = {}
    for fmt in (None, "q4_0"):
        out[fmt] = d.parent / f"{request.param}-{fmt or 'f32'}.gguf"
        export_gguf(d, out[fmt], parse_policy("moqe", fmt) if fmt else None)
    return request.param, d, out


def test_family_export_reads_back_and_llama_cpp_agrees(family, tmp_path):
    """Round trip bit-identical; where llama.cpp is given, its converter's file reads in ours with the
    checkpoint's logits, and llama-completion runs our exports to our greedy text."""
    from toolkit.bench.anchors import LlamaCpp

    name, d, out = family
    for fmt in (None, "q4_0"):
        ours, tok = load_model(d, policy=parse_policy("moqe", fmt) if fmt else None)
        back, _ = load_model(out[fmt])
        ids = np.array([tok.encode(PROMPT)])
        assert np.array_equal(_logits(back, ids), _logits(ours, ids)), (name, fmt)
    root = os.environ.get("MOQE_LLAMA_CPP")
    if not root:
        pytest.skip("no llama.cpp build: set MOQE_LLAMA_CPP for the converter and llama-completion checks")
    ll = LlamaCpp(root)
    if name not in OWN_TOKENIZER:
        conv = tmp_path / "converted.gguf"
        ll.convert(d, conv, "f32")
        ours, tok = load_model(d)
        theirs, _ = load_model(conv)
        ids = np.array([tok.encode(PROMPT)])
        assert np.array_equal(_logits(theirs, ids), _logits(ours, ids)), name
    exe = next(p for p in (Path(root) / s / "llama-completion" for s in (".", "bin", "build/bin")) if p.is_file())
    for fmt, n in ((None, 12), ("q4_0", 6)):  # q4_0: llama.cpp multiplies by q8_0-quantized activations, and these
        # random models' greedy paths meet near-ties; the first 6 tokens are held (gpt-oss's part ways at the 9th)
        p = subprocess.run([str(exe), "-m", str(out[fmt]), "-p", PROMPT, "-n", "12", "--temp", "0", "-no-cnv",
                            "--no-warmup", "-t", "1", "--simple-io"], capture_output=True, text=True, errors="replace",
                           timeout=300)
        m, tok = load_model(out[fmt])
        text = tok.decode([e.token for e in generate_tokens(m, [tok.encode(PROMPT)], SamplingParams(max_new_tokens=n))])
        assert p.returncode == 0 and text.strip() in p.stdout, (name, fmt, text, p.stdout[-500:])


@pytest.mark.parametrize("name,extra,message", [
    ("qwen2moe", dict(mlp_only_layers=[1]), "dense MLP layers"),
    ("qwen3moe", dict(norm_topk_prob=False), "top-k renormalisation"),
])
def test_export_refuses_what_llama_cpp_would_run_differently(tmp_path, name, extra, message):
    d = _family_checkpoint(tmp_path / "m", name, **extra)
    with pytest.raises(ModelError, match=message):
        export_gguf(d, tmp_path / "m.gguf", None)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("qtype,experts", [("Q4_0", {"q4_0"}), ("Q8_0", {"q8_0"}), ("Q4_K_M", {"q4_k", "q6_k"}),
                                           ("Q2_K", {"q2_k"}), ("Q3_K_M", {"q3_k"}), ("Q5_K_M", {"q5_k"})])
def test_a_llama_quantize_file_runs_as_llama_cpp_runs_it(tmp_path, qtype, experts):
    """llama.cpp's converter then ``llama-quantize``: expert tensors kept as stored (k-quants included), the q6_K head
    as stored; our greedy text equals llama-completion's on the same file (and, for Q4_0 / Q8_0, the checkpoint's)."""
    from toolkit.bench.anchors import LlamaCpp

    root = os.environ.get("MOQE_LLAMA_CPP")
    ll = LlamaCpp(root) if root else None
    if ll is None or ll.converter is None or ll.quantize is None:
        pytest.skip("no llama.cpp: set MOQE_LLAMA_CPP to a llama.cpp build (llama-quantize) inside its source tree")
    pytest.importorskip("torch")
    f16, out = tmp_path / "f16.gguf", tmp_path / f"{qtype}.gguf"
    ll.convert(MODEL, f16, "f16")
    subprocess.run([str(ll.quantize), str(f16), str(out), qtype], capture_output=True, check=True, timeout=600)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    m, tok = load_model(out)
    got = {w.fmt.name for layer in m.layers for w in layer.ffn.expert_weights}
    assert experts <= got, (qtype, got)  # llama.cpp's mixes put some expert tensors one type up (q3_K in Q2_K)
    if qtype == "Q4_0":
        assert types["output.weight"] == "Q6_K"
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_new_tokens=12)
    ours = [e.token for e in generate_tokens(m, [ids], params)]
    if qtype in ("Q4_0", "Q8_0"):
        ref, _ = load_model(MODEL)
        assert ours == [e.token for e in generate_tokens(ref, [ids], params)]
    exe = next(p for p in (Path(root) / s / "llama-completion" for s in (".", "bin", "build/bin")) if p.is_file())
    p = subprocess.run([str(exe), "-m", str(out), "-p", PROMPT, "-n", "12", "--temp", "0", "-no-cnv", "--no-warmup",
                        "-t", "1", "--simple-io"], capture_output=True, text=True, errors="replace", timeout=300)
    text = tok.decode(ours)
    assert p.returncode == 0 and text.strip() in p.stdout, (qtype, text, p.stdout[-500:])


def test_a_k_quant_expert_runs_as_stored(tmp_path, exports):
    """k-quant experts (q6_K blocks here) load as stored and run in their own Numba kernels: prefill and decode logits
    equal those of the NumPy reference backend on the same file (within the kernels' summation order)."""
    from toolkit.formats import get_format

    def blocks(a):
        return get_format("q6_k").quantize(np.asarray(a, np.float32)).arrays["blocks"]

    _with_q6_k(exports[None], tmp_path / "k.gguf", "blk.1.ffn_down_exps.weight", blocks)
    m, tok = load_model(tmp_path / "k.gguf")
    assert m.layers[1].ffn.expert_weights[1].fmt.name == "q6_k"
    ids = np.array([tok.encode("It is a truth universally acknowledged")])
    got, want = _logits(m, ids), _logits(load_model(tmp_path / "k.gguf", backend="numpy")[0], ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_glm_nextn_layers_are_left_out(tmp_path):
    """GLM-4.5 files from llama.cpp's converter count the NextN (MTP) layers in ``block_count`` and carry their
    tensors after the trunk's: the model reads the trunk only, with the logits of the file without them."""
    d = _family_checkpoint(tmp_path / "m", "glm4moe")
    plain, mtp = tmp_path / "plain.gguf", tmp_path / "mtp.gguf"
    export_gguf(d, plain, None)
    r = gguf.GGUFReader(plain)
    w = gguf.GGUFWriter(mtp, "glm4moe")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = f.contents() + 1 if f.name == "glm4moe.block_count" else f.contents()
        w.add_key_value(f.name, value, f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    w.add_uint32("glm4moe.nextn_predict_layers", 1)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type if t.tensor_type not in (0, 1) else None)
    w.add_tensor("blk.2.nextn.eh_proj.weight", np.ones((64, 128), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    a, tok = load_model(plain)
    b, _ = load_model(mtp)
    assert b.cfg.num_layers == a.cfg.num_layers == 2
    ids = np.array([tok.encode(PROMPT)])
    assert np.array_equal(_logits(b, ids), _logits(a, ids))
