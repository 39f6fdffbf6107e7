"""Every API endpoint through ``gradio_client`` on an in-process server; bad input is a message; two clients at once."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from gradio_client import Client  # noqa: E402

from app import AppSettings, build_app  # noqa: E402

SLOTS = ["none", "moqe", "f32", "int4", "moqe", "q8_0", "int2", "moqe", "q4_0", "int3", "all-linear", "q8_0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    demo = build_app(AppSettings(output_root=tmp_path_factory.mktemp("out"), cache_size=3))
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=None, quiet=True)
    yield demo
    demo.close()


def wait_ready(client, limit_s: float = 900) -> dict:
    """The app's own readiness signal: /kernel_status reports ready once every kernel is compiled or loaded
    (the bound is generous: a cold cache on a loaded machine compiles for minutes; nothing else waits on it)."""
    t0 = time.monotonic()
    while True:
        st = client.predict(api_name="/kernel_status")
        if st["ready"] or time.monotonic() - t0 > limit_s:
            return st
        time.sleep(0.5)


@pytest.fixture(scope="module")
def client(server):
    c = Client(server.local_url, verbose=False)
    st = wait_ready(c)
    assert st["ready"] and st["error"] is None, st
    return c


def test_kernel_status_is_ready_with_every_family(client):
    st = client.predict(api_name="/kernel_status")
    from toolkit.warmup import FAMILIES_ALL, KV_ALL, POLICIES

    # f32 model, quantized KV caches, formats under each policy, then each format's compiled decode step with
    # each quantized KV cache
    quantized_kv = sum(k != "f32" for k in KV_ALL)
    families = 1 + quantized_kv + len(FAMILIES_ALL) * len(POLICIES) + len(FAMILIES_ALL) * quantized_kv
    assert st["ready"] and st["done"] == st["total"] == families and "Kernels ready" in st["line"]


def compare(client, prompt, n_new=4, seed=1, temperature=0.0, slots=SLOTS, n=2):
    return client.predict(n, *slots, prompt, n_new, temperature, seed, api_name="/compare")


def test_compare_two_configurations(client):
    out = compare(client, "It is a truth")
    texts, metrics, table = out[:4], out[4:8], out[8]
    assert texts[0] and texts[1] and texts[2] == texts[3] == ""
    assert "tok/s" in metrics[0] and "B/token" in metrics[1]
    assert [r[0] for r in table["data"]] == ["f32 (none) / KV f32", "moqe:int4 / KV q8_0"]
    row = dict(zip(table["headers"], table["data"][1]))
    assert row["tokens"] == 4 and row["tok/s"] > 0 and row["KV B/token"] < 2048 and row["weight MB"] < 69


def test_compare_four_configurations(client):
    out = compare(client, "ROMEO.", n_new=2, n=4)
    assert all(out[:4]) and len(out[8]["data"]) == 4


BAD_INPUT = [  # keyword overrides of compare -> words in the message
    ({"prompt": ""}, "empty"),
    ({"prompt": "word " * 300}, "exceeds the context"),
    ({"n_new": 5000}, "max new tokens"),
    ({"slots": ["int9"] + SLOTS[1:]}, "unknown expert format"),
    ({"n": 7}, "choices"),  # Gradio refuses it before the handler
]


@pytest.mark.parametrize("kw,words", BAD_INPUT)
def test_bad_input_is_a_message_and_the_app_keeps_serving(client, kw, words):
    args = {"prompt": "Hello", **kw}
    with pytest.raises(Exception, match=words):
        compare(client, **args)
    assert compare(client, "Hello", n_new=1)[0]  # still serving


def test_measure(client):
    table, scatter, bars = client.predict(2, *SLOTS, 200, api_name="/measure")
    rows = [dict(zip(table["headers"], r)) for r in table["data"]]
    assert len(rows) == 2 and all(1 < r["perplexity"] < 8192 for r in rows)
    assert rows[1]["bits/weight"] < rows[0]["bits/weight"]
    # KLD from the full-precision model: 0 for the f32 row (f32 KV), positive for the quantized one
    assert rows[0]["KLD mean"] == 0 and rows[0]["top-1 agree %"] == 100
    assert rows[1]["KLD mean"] > 0 and rows[1]["KLD p99"] >= rows[1]["KLD mean"] and 0 < rows[1]["top-1 agree %"] <= 100
    points = scatter["value"]["data"]  # the plot comes with its axes scaled to its points
    assert len(points) == 2 and len(bars["data"]) == 4 and "(reference)" in points[0][0]
    for i, lim in ((1, scatter["x_lim"]), (2, scatter["y_lim"])):
        assert lim[0] < min(p[i] for p in points) <= max(p[i] for p in points) < lim[1]


def test_quantize_save_and_load_bundle(client, tmp_path):
    msg, pick = client.predict("moqe", "int8", "bundles/b8", api_name="/quantize_save")
    assert "Saved" in msg and "bundles/b8" in msg
    for bad in ("../escape", "/tmp/elsewhere"):
        with pytest.raises(Exception, match="outside the output root"):
            client.predict("moqe", "int8", bad, api_name="/quantize_save")
    with pytest.raises(Exception, match="unknown"):
        client.predict("moqe", "int5", "b5", api_name="/quantize_save")
    status = client.predict("bundles/b8", api_name="/load_bundle")
    assert "b8" in status and "moqe:int8" in status
    bundle_slots = ["none", "moqe", "f32", "none", "moqe", "q4_0"] + SLOTS[6:]
    out = compare(client, "Hello", n_new=2, slots=bundle_slots)  # this session now runs the bundle as written
    assert all(r[4] < 32 for r in out[8]["data"])  # bits/weight: the int8 experts
    with pytest.raises(Exception, match="already quantized"):
        compare(client, "Hello", n_new=2)
    with pytest.raises(Exception, match="no UQFF bundle"):
        client.predict("missing", api_name="/load_bundle")
    assert "base model" in client.predict(api_name="/use_base_model")
    # the base model's bits/weight as it is held: every weight f32 but the embeddings and head, kept in the
    # checkpoint's f16 (Runtime.keeps16)
    from toolkit.model.checkpoint import Checkpoint

    ck = Checkpoint(Path(__file__).resolve().parents[1] / "data" / "model")
    shapes = {n: ck.get(n).shape for n in ck.keys()}
    params = sum(int(np.prod(s)) for s in shapes.values() if len(s) >= 2)  # the report's rows: no norms, no biases
    tables = sum(int(np.prod(shapes[n])) for n in ("model.embed_tokens.weight", "lm_head.weight"))
    assert compare(client, "Hello", n_new=2)[8]["data"][0][4] == round(32 - 16 * tables / params, 2)


def test_plan_save_and_compare_the_bundle(client, monkeypatch):
    """The Plan tab's flow on a fake calibration (the real one takes minutes): calibrate, plan a budget, a too
    small budget is a message, save the plan as a bundle, load it and run it in Compare."""
    from test_app_units import PLAN_FORMATS, fake_sensitivity

    from app import plan

    monkeypatch.setattr(plan, "calibrate", lambda model_dir, *a, **k: fake_sensitivity(model_dir, PLAN_FORMATS))
    assert "64 expert projections" in client.predict(api_name="/plan_calibrate")
    status, table, points, chart = client.predict("bits/weight", 3.5, 5.0, 1024, api_name="/plan")
    total = dict(zip(table["headers"], table["data"][-1]))
    assert total["format"] == "total" and total["bits/weight"] <= 3.5 and "predicted mean KLD" in status
    assert len(points["data"]) == len(PLAN_FORMATS) + 9 + 1 and "this plan (predicted)" in str(chart)
    with pytest.raises(Exception, match="too small"):
        client.predict("MB", 3.5, 1.0, 1024, api_name="/plan")
    msg, pick = client.predict("bits/weight", 3.5, 5.0, "plan-35", api_name="/plan_save")
    assert "Saved **plan-35**" in msg and "plan-35.plan" in msg
    with pytest.raises(Exception, match="outside the output root"):
        client.predict("bits/weight", 3.5, 5.0, "../plan", api_name="/plan_save")
    assert "plan=plan-35.plan#" in client.predict("plan-35", api_name="/load_bundle")
    bundle_slots = ["none", "moqe", "f32", "none", "moqe", "q8_0"] + SLOTS[6:]
    out = compare(client, "Hello", n_new=2, slots=bundle_slots)
    assert out[0] and out[8]["data"][0][4] < 32  # the planned experts, as written
    with pytest.raises(Exception, match="switch to the base model to plan"):
        client.predict("bits/weight", 4.0, 5.0, 1024, api_name="/plan")
    assert "base model" in client.predict(api_name="/use_base_model")


def test_two_clients_at_once_get_their_own_outputs(server):
    jobs = [("It is a truth universally", 1), ("KING HENRY.", 2)]
    alone = [compare(Client(server.local_url, verbose=False), p, n_new=12, seed=s, temperature=0.8) for p, s in jobs]
    assert alone[0][0] != alone[1][0]
    results: dict[int, tuple] = {}

    def run(i):
        p, s = jobs[i]
        results[i] = compare(Client(server.local_url, verbose=False), p, n_new=12, seed=s, temperature=0.8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i][:2] for i in range(2)] == [alone[i][:2] for i in range(2)]
