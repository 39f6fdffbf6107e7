"""The serving engine without HTTP (toolkit/serve/engine.py): sequences that join and leave the running batch give
what each gives alone, on numba and on the emulated device (slots moved on the device); prefill in chunks and in
batches; streamed text and stop strings (toolkit/serve/detok.py); chat templates against transformers'."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from toolkit.cli import DEFAULT_MODEL
from toolkit.errors import ModelError
from toolkit.model import SamplingParams, generate_tokens
from toolkit.serve.detok import Detokenizer, StopMatcher
from toolkit.serve.engine import Engine, GenParams, QueueFull

PROMPTS = ["It is a truth universally acknowledged", "KING. My lord,", "The", "Once upon a time there was a little",
           "HAMLET. To be, or not to be, that is the question:", "Enter"]


@pytest.fixture(scope="module")
def bundled():
    from toolkit.load import load_model

    return {b: load_model(DEFAULT_MODEL, backend=b, kv_cache=kv) for b, kv in (("numba", None), ("cuda-emu", "q8_0"))}


def _alone(m, tok, prompt: str, n: int) -> list:
    eos = tuple(m.cfg.eos_token_ids)
    p = SamplingParams(max_new_tokens=n, stop_token_ids=eos)
    return [ev.token for ev in generate_tokens(m, [tok.encode(prompt)], p) if ev.token not in eos]


def _run_together(engine, jobs: list) -> list:
    """Submit every (prompt ids, max_tokens) at once from threads; -> each job's generated ids and finish."""
    out = [None] * len(jobs)

    def go(i, ids, n):
        toks, last = [], None
        for ev in engine.generate(ids, GenParams(max_tokens=n, temperature=0.0)):
            toks += ev.tokens
            last = ev
        out[i] = (toks, last.finish)

    threads = [threading.Thread(target=go, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


# (backend, slots, prefill_chunk, prefill_tokens): batches that join and leave, chunked prompts, batches split by
# the prefill token budget, fewer slots than requests (a queue)
CASES = [("numba", 8, 512, 2048, 6), ("numba", 3, 4, 2048, 6), ("numba", 8, 512, 12, 6)]
LENGTHS = [5, 17, 9, 30, 3, 12]  # different max_tokens: sequences finish at different steps, slots move


@pytest.mark.parametrize("backend,slots,chunk,budget,jobs", CASES)
def test_sequences_that_join_and_leave_give_what_each_gives_alone(bundled, backend, slots, chunk, budget, jobs):
    m, tok = bundled[backend]
    prompts, lengths = PROMPTS[:jobs], [n if jobs > 3 else min(n, 8) for n in LENGTHS[:jobs]]
    want = [_alone(m, tok, p, n) for p, n in zip(prompts, lengths)]
    e = Engine(m, tok, slots=slots, context=256, prefill_chunk=chunk, prefill_tokens=budget)
    try:
        got = _run_together(e, [(tok.encode(p), n) for p, n in zip(prompts, lengths)])
        assert e.state()["slots_used"] == 0 and e.state()["cache_tokens"] == 0
    finally:
        e.close()
    for (toks, finish), w, n in zip(got, want, lengths):
        assert toks == w
        assert finish == ("length" if len(w) == n else "stop")


class _IdText:
    """A tokenizer stand-in for a model without one: each id as ``<id>``."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{int(i)}>" for i in ids)


@pytest.mark.parametrize("backend", ["cuda-emu", "numpy"])
def test_on_a_device_slots_move_on_the_device(tmp_path, backend):
    """The emulated device (the CUDA kernels' C run on the CPU, every copy counted): a tiny Mixtral, five requests
    through two slots in chunks of 3 prompt tokens, each as it decodes alone; the numpy backend as a second check."""
    import tiny_model
    from toolkit.model import MoEModel, load_config, load_weights
    from toolkit.model.checkpoint import Checkpoint

    d = tiny_model.write(tmp_path / "tiny", {**tiny_model.CONFIG, "hidden_size": 128, "intermediate_size": 128})  # head dim 32
    cfg = load_config(d)
    m = MoEModel(cfg, load_weights(Checkpoint(d), cfg), backend)
    rng = np.random.default_rng(1)
    jobs = [(rng.integers(3, 64, n).tolist(), k) for n, k in ((7, 3), (4, 9), (9, 5), (2, 6), (5, 2))]
    want = []
    for ids, k in jobs:
        want.append([ev.token for ev in generate_tokens(m, [ids], SamplingParams(max_new_tokens=k))])
    e = Engine(m, _IdText(), slots=2, context=32, prefill_chunk=3)
    moved = []
    real = e.cache.move
    e.cache.move = lambda moves: (moved.extend(moves), real(moves))
    try:
        e.eos = ()
        got = _run_together(e, jobs)
        assert e.state()["slots_used"] == 0
    finally:
        e.close()
    assert [g[0] for g in got] == want
    assert moved  # some sequence changed slots


def test_a_finished_slot_is_refilled_by_moving_the_last_running_sequence(bundled):
    """The KV rows move with the sequence: after a move, decoding from the new slot equals decoding from the old."""
    m, tok = bundled["numba"]
    e = Engine(m, tok, slots=3, context=128)
    try:
        moved = []
        real = e.cache.move
        e.cache.move = lambda moves: (moved.extend(moves), real(moves))
        events = [[], [], []]
        with e._cv:  # all three queued before the engine looks: one prefill batch, longest prompt in slot 0
            for i, n in enumerate((2, 20, 25)):
                e.submit(tok.encode(PROMPTS[i]), GenParams(max_tokens=n, temperature=0.0, ignore_eos=True), 1,
                         events[i].append)
        for _ in range(3000):
            if all(ev and ev[-1].finish for ev in events):
                break
            threading.Event().wait(0.01)
    finally:
        e.close()
    assert moved == [(2, 0)]  # the first sequence finished first; the one in the last slot took its place
    got = [t for ev in events[2] for t in ev.tokens]  # ignore_eos: no end-of-sequence token ends either side
    p = SamplingParams(max_new_tokens=25)
    assert got == [ev.token for ev in generate_tokens(m, [tok.encode(PROMPTS[2])], p)] and len(got) == 25


def test_requests_past_the_context_or_slots_and_a_full_queue_are_refused(bundled):
    m, tok = bundled["numba"]
    e = Engine(m, tok, slots=2, context=64, max_queue=0)
    try:
        with pytest.raises(ModelError, match="context is 64 tokens; the request needs 70"):
            e.submit(list(range(10)), GenParams(max_tokens=60))
        with pytest.raises(ModelError, match="at most 2 sequences"):
            e.submit([1, 2], GenParams(max_tokens=4), n=3)
        with pytest.raises(ModelError, match="token ids must lie"):
            e.submit([1, 10**6], GenParams(max_tokens=4))
        with pytest.raises(QueueFull, match="queue is full"):
            e.submit([1, 2], GenParams(max_tokens=4))
    finally:
        e.close()
    with pytest.raises(ModelError, match="slots must be"):
        Engine(m, tok, slots=0)


def test_an_aborted_request_leaves_and_the_others_go_on(bundled):
    m, tok = bundled["numba"]
    e = Engine(m, tok, slots=4, context=256)
    try:
        events = []
        long = e.submit(tok.encode(PROMPTS[0]), GenParams(max_tokens=200, temperature=0.0, ignore_eos=True), 1,
                        events.append)
        got = _run_together(e, [(tok.encode(PROMPTS[1]), 12)])
        long.abort()
        for _ in range(200):
            if e.state()["slots_used"] == 0:
                break
            threading.Event().wait(0.02)
        assert e.state()["slots_used"] == 0
        assert events[-1].finish == "abort" and sum(len(ev.tokens) for ev in events) < 200
        assert got[0][0] == _alone(m, tok, PROMPTS[1], 12)
    finally:
        e.close()


# ---- streamed text ---------------------------------------------------------------------------------------------
def test_streamed_pieces_make_the_whole_text(bundled):
    """Incremental detokenization: the pieces of any id sequence (multi-byte characters split across tokens
    included) join to what decoding the whole sequence gives."""
    _, tok = bundled["numba"]
    rng = np.random.default_rng(0)
    texts = ["naïve café — “quoted” ünïcödé 你好 🙂 end", "plain words, and more words.\n\nNew line."]
    for text in texts:
        ids = tok.encode(text, add_bos=False)
        d = Detokenizer(tok)
        assert "".join(d.add(t) for t in ids) + d.flush() == tok.decode(ids)
    for _ in range(20):
        ids = rng.integers(3, tok.vocab_size, 40).tolist()
        d = Detokenizer(tok)
        assert "".join(d.add(t) for t in ids) + d.flush() == tok.decode(ids)


STOPS = [  # (pieces, stops, what is sent piece by piece, hit)
    (["Hello", " wor", "ld"], ["world"], ["Hello", " ", ""], True),
    (["ab", "c", "d"], ["cd"], ["ab", "", ""], True),
    (["ab", "c", "x"], ["cd"], ["ab", "", "cx"], False),
    (["x", "STO", "P", "y"], ["STOP"], ["x", "", ""], True),
    (["one", " two"], ["three"], ["one", " two"], False),
    (["aaa", "ab"], ["aab"], ["a", "a"], True),
    (["end."], ["."], ["end"], True),
    (["no stops here"], [], ["no stops here"], False),
]


@pytest.mark.parametrize("pieces,stops,sent,hit", STOPS)
def test_stop_strings_hold_back_what_could_begin_one(pieces, stops, sent, hit):
    s = StopMatcher(stops)
    got = []
    for p in pieces:
        out, h = s.feed(p)
        got.append(out)
        if h:
            break
    assert got == sent[: len(got)] and h == hit
    whole = "".join(pieces)
    cut = min([whole.find(x) for x in stops if x in whole], default=len(whole))
    assert "".join(got) + s.flush() == whole[:cut]


# ---- chat templates ----------------------------------------------------------------------------------------------
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}"
           "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
TOJSON = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "“ünïcode”"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
]


@pytest.mark.parametrize("template", [CHATML, MISTRAL, TOJSON], ids=["chatml", "mistral", "tojson"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_a_chat_template_renders_as_transformers_renders_it(tmp_path, template, conv, gen):
    """The same template in a model folder's tokenizer_config.json: our rendering equals transformers'
    ``apply_chat_template(tokenize=False)``, and a template that raises does so in both, with its message."""
    import json
    import shutil

    transformers = pytest.importorskip("transformers")
    from toolkit.serve.chat import TemplateError, load_chat_template

    shutil.copy(f"{DEFAULT_MODEL}/tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads(open(f"{DEFAULT_MODEL}/tokenizer_config.json").read())
    cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = load_chat_template(tmp_path)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    msgs = CONVERSATIONS[conv]
    try:
        want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    except Exception as e:  # noqa: BLE001 - transformers raises its TemplateError
        with pytest.raises(TemplateError, match="alternate"):
            ours.render(msgs, add_generation_prompt=gen)
        assert "alternate" in str(e)
        return
    assert ours.render(msgs, add_generation_prompt=gen) == want


def test_the_bundled_template_and_a_model_without_one(tmp_path):
    import shutil

    from toolkit.serve.chat import load_chat_template

    t = load_chat_template(DEFAULT_MODEL)
    assert t.render([{"role": "user", "content": "Hi"}]) == "<s>USER. Hi\nASSISTANT."
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(f"{DEFAULT_MODEL}/{name}", tmp_path / name)
    assert load_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ModelError, match="does not parse"):
        load_chat_template(tmp_path)


def test_a_bundle_keeps_its_models_chat_template(tmp_path):
    """``chat_template.jinja`` travels into a UQFF bundle, so a served bundle answers chat requests as its model."""
    import shutil

    from test_uqff_support import build, tiny_checkpoint
    from toolkit.quant import parse_policy
    from toolkit.serve.chat import load_chat_template
    from toolkit.uqff import load_bundle

    d = tiny_checkpoint(tmp_path / "m")
    shutil.copy(f"{DEFAULT_MODEL}/chat_template.jinja", d / "chat_template.jinja")
    build(d, tmp_path / "b", parse_policy("moqe", "int8"))
    load_bundle(tmp_path / "b", "numpy")  # the bundle with the extra file still passes every check
    t = load_chat_template(tmp_path / "b")
    assert t is not None and t.render([{"role": "user", "content": "x"}]).endswith("USER. x\nASSISTANT.")
