"""``moqe serve`` through the real ``openai`` client, on a server this module starts on 127.0.0.1 (the bundled model,
numba): completions and chat, streamed and not, logprobs, stop strings, seeds, ``n``, a client that disconnects,
bad requests (each a 400 naming what is wrong), greedy output against ``moqe generate``, alone and with 7 other
requests in flight, and the metrics. Speed is measured by ``python -m toolkit.bench serve``, not here."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from toolkit.cli import DEFAULT_MODEL  # noqa: E402
from toolkit.model import SamplingParams, generate_tokens  # noqa: E402

NAME = "bundled"
PROMPTS = ["It is a truth universally acknowledged", "KING HENRY. Once more unto the breach,", "The", "My lord, I"]


@pytest.fixture(scope="module")
def server():
    from toolkit.serve import make_server

    s = make_server(DEFAULT_MODEL, name=NAME, port=0, slots=8, max_queue=32).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _solo(server, ids: list, **kw) -> list:
    """What ``moqe generate`` runs (generate_tokens on the same model), the end-of-sequence token left out. The
    engine thread owns the model: this runs through a second load of the same model."""
    m, eos = _reference_model()
    p = SamplingParams(max_new_tokens=kw.get("max_tokens", 16), temperature=kw.get("temperature", 0.0),
                       seed=kw.get("seed", 0), stop_token_ids=eos)
    return [ev.token for ev in generate_tokens(m, [ids], p) if ev.token not in eos]


_REF = {}


def _reference_model():
    if "m" not in _REF:
        from toolkit.load import load_model

        m, tok = load_model(DEFAULT_MODEL, backend="numba")
        _REF["m"], _REF["tok"] = m, tok
    return _REF["m"], tuple(_REF["m"].cfg.eos_token_ids)


def _tok():
    _reference_model()
    return _REF["tok"]


def _post(server, path: str, body, raw: bool = False) -> httpx.Response:
    data = body if raw else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json"}, timeout=60)


def _metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


# ---- completions and chat ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_completion_is_moqe_generates_tokens(server, client, prompt):
    tok = _tok()
    ids = tok.encode(prompt)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    want = _solo(server, ids, max_tokens=24)
    assert c.model_extra["token_ids"] == want
    assert c.text == tok.decode(want)
    assert c.finish_reason == ("length" if len(want) == 24 else "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == min(24, len(want) + 1)


def test_the_cli_generate_prints_the_servers_text(server, client, capsys):
    from toolkit.cli import main

    prompt = PROMPTS[0]
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "20"]) == 0
    printed = capsys.readouterr().out
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    assert printed.rstrip("\n") == prompt + r.choices[0].text


def test_streamed_text_is_the_whole_text(client):
    whole = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_renders_the_template_and_streams_the_same_text(client):
    msgs = [{"role": "system", "content": "A play."}, {"role": "user", "content": "Who art thou?"}]
    whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0,
                                           extra_body={"return_token_ids": True})
    tok = _tok()
    prompt = tok.encode("A play.\n\nUSER. Who art thou?\nASSISTANT.", add_bos=False)
    assert whole.choices[0].model_extra["prompt_token_ids"] == [tok.bos_token_id] + prompt
    assert whole.usage.prompt_tokens == len(prompt) + 1
    parts, roles = [], []
    for ch in client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0, stream=True):
        d = ch.choices[0].delta
        roles += [d.role] if d.role else []
        parts.append(d.content or "")
    assert roles == ["assistant"] and "".join(parts) == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_logprobs_are_the_models(client):
    """Each generated token's logprob, and the top alternatives, are the log-softmax of the model's logits at its
    position (a full forward of prompt + completion here)."""
    m, _ = _reference_model()
    tok = _tok()
    ids = tok.encode(PROMPTS[0])
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True})
    out = r.choices[0].model_extra["token_ids"]
    seq = np.array(ids + out)
    logits = np.asarray(m.forward(seq[None], m.new_cache(1, len(seq))))[0]  # [n, V]
    lp = r.choices[0].logprobs
    for j, t in enumerate(out):
        want = _log_softmax(logits[len(ids) - 1 + j])
        assert abs(lp.token_logprobs[j] - want[t]) < 1e-4
        top = sorted(lp.top_logprobs[j].values(), reverse=True)
        assert len(top) == 3 and abs(top[0] - want.max()) < 1e-4
    ch = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Speak."}], max_tokens=4,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = ch.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-9
                                     for c in content)
    assert "".join(c.token for c in content) == ch.choices[0].message.content


def test_echo_scores_the_prompt(client):
    """Completions' echo with max_tokens 0 (what evaluation harnesses send): the prompt's own logprobs."""
    m, _ = _reference_model()
    ids = _tok().encode(PROMPTS[1])
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPTS[1] and lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    logits = np.asarray(m.forward(np.array(ids)[None], m.new_cache(1, len(ids))))[0]
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - _log_softmax(logits[i - 1])[ids[i]]) < 1e-4


def test_a_long_prompt_is_scored_across_prefill_chunks(server):
    """A prompt past one prefill chunk (the server's is 512 tokens) scored by echo equals one forward pass."""
    m, _ = _reference_model()
    text = (Path(DEFAULT_MODEL).parent / "heldout.txt").read_text(encoding="utf-8")[:6000]
    ids = _tok().encode(text)[:700]
    r = _post(server, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    logits = np.asarray(m.forward(np.array(ids)[None], m.new_cache(1, len(ids))))[0]
    want = [_log_softmax(logits[i - 1])[ids[i]] for i in range(1, len(ids))]
    assert got[0] is None and np.abs(np.array(got[1:]) - want).max() < 1e-4


def test_stop_strings_cut_the_text_before_them(client):
    whole = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0).choices[0].text
    stop = whole[12:15]
    assert len(stop) == 3
    want = whole[: whole.find(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop, "qqqq"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want


def test_a_seed_repeats_and_matches_moqe_generate(server, client):
    kw = dict(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0.9, extra_body={"return_token_ids": True})
    a = client.completions.create(seed=7, **kw).choices[0].model_extra["token_ids"]
    b = client.completions.create(seed=7, **kw).choices[0].model_extra["token_ids"]
    c = client.completions.create(seed=8, **kw).choices[0].model_extra["token_ids"]
    assert a == b and a != c
    assert a == _solo(server, _tok().encode(PROMPTS[2]), max_tokens=20, temperature=0.9, seed=7)
    two = client.completions.create(seed=7, n=2, **kw)
    assert [ch.index for ch in two.choices] == [0, 1] and two.choices[0].model_extra["token_ids"] == a


# ---- continuous batching ---------------------------------------------------------------------------------------
def test_greedy_output_is_the_same_with_seven_other_requests_in_flight(server, client):
    """The target request runs while 7 others (streamed, sampled and greedy, prompts of other lengths) decode."""
    tok = _tok()
    ids = tok.encode(PROMPTS[1])
    want = _solo(server, ids, max_tokens=32)
    started, results = threading.Barrier(8), {}

    def other(i):
        started.wait()
        s = client.completions.create(model=NAME, prompt=PROMPTS[i % 4] + " and" * i, max_tokens=48, stream=True,
                                      temperature=0.7 if i % 2 else 0, seed=i)
        results[i] = "".join(ch.choices[0].text for ch in s)

    threads = [threading.Thread(target=other, args=(i,)) for i in range(7)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)  # the others' prefill first
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=32, temperature=0,
                                  extra_body={"return_token_ids": True})
    for t in threads:
        t.join(120)
    assert len(results) == 7
    assert r.choices[0].model_extra["token_ids"] == want


def test_a_client_that_disconnects_frees_its_slot(server):
    before = _metric(server, "moqe_requests_total", finished_reason="abort")
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body) as s:
            lines = s.iter_lines()
            got = [next(lines) for _ in range(6)]
    assert any(x.startswith("data: ") for x in got)
    deadline = time.monotonic() + 30
    while server.engine.state()["slots_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.state()["slots_used"] == 0
    assert _metric(server, "moqe_requests_total", finished_reason="abort") == before + 1


# ---- bad requests ------------------------------------------------------------------------------------------------
BAD = [  # (path, body, status, words in the message)
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
    ("/v1/completions", {"model": NAME}, 400, "'prompt' is required"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": 1e9}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 1000}, 400, "'n'"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "seed": -3}, 400, "seed"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": ""}, 400, "empty stop"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"banana": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": NAME, "prompt": [1, 2, 99999]}, 400, "token ids"),
    ("/v1/completions", {"model": NAME, "prompt": []}, 400, "empty"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "echo"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "best_of": 3}, 400, "'best_of' is not supported"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"model": NAME, "prompt": "word " * 3000}, 400, "maximum context length is 2048"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2048}, 400, "maximum context length"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "tool", "content": "x"}]}, 400, "no role tool"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": []}, 400,
     "'tools' is not supported"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "needs 'logprobs'"),
    ("/v1/nothing", {}, 404, "no such path"),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_a_bad_request_is_refused_naming_what_is_wrong(server, path, body, status, words):
    r = _post(server, path, body, raw=isinstance(body, bytes))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] and "param" in err
    assert server.engine.state()["slots_used"] == 0  # refused before work started


def test_the_openai_client_sees_the_error(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt="word " * 3000, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


# ---- models, health, metrics -----------------------------------------------------------------------------------
def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    toks0 = _metric(server, "moqe_generation_tokens_total")
    client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert _metric(server, "moqe_generation_tokens_total") == toks0 + 5
    assert _metric(server, "moqe_time_to_first_token_seconds_count") >= 1
    assert _metric(server, "moqe_slots", model_name=NAME) == 8
    assert _metric(server, "moqe_expert_routed_tokens_total", layer="0") > 0


def test_a_response_carries_its_routing_when_asked(server, client):
    """Per MoE layer, the tokens this request routed: every prompt token and every generated token fed back (the
    last MoE layer runs on the prompt's last token only), top-k experts each."""
    ids = _tok().encode(PROMPTS[0])
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                  extra_body={"return_routing": True, "ignore_eos": True})
    rt = r.choices[0].model_extra["routing"]
    counts = np.array(rt["counts"])  # [L, E]
    A, L = server.engine.cfg.top_k, len(rt["layers"])
    assert counts.shape == (L, server.engine.cfg.num_experts)
    fed = len(ids) + 6 - 1
    assert counts[:-1].sum(1).tolist() == [fed * A] * (L - 1) and counts[-1].sum() == (1 + 6 - 1) * A
    plain = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2)
    assert "routing" not in (plain.choices[0].model_extra or {})


def test_the_curl_examples_in_the_docs_work(server):
    """Every ``curl`` line of docs/serving.md, against this server (its address and model name put in)."""
    import re
    import shutil
    import subprocess

    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", doc, re.S)
    commands = [c for b in blocks for c in b.replace("\\\n", " ").splitlines() if c.startswith("curl ")]
    assert len(commands) == 3
    for cmd in commands:
        cmd = cmd.replace("http://127.0.0.1:8000", server.url).replace('"model": "model"', f'"model": "{NAME}"')
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120, check=True).stdout
        if "/metrics" in cmd:
            assert "moqe_expert_routed_tokens_total" in out
        elif '"stream": true' in cmd:
            events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert json.loads(out)["choices"][0]["text"]
