"""The app serves its page on a busy machine: the kernel warm-up starts only once the server is up, and a
Gradio start-up self-check that times out (one HEAD with a 3 s timeout) is checked again patiently instead
of ending the app with "When localhost is not accessible, a shareable link must be created"."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import httpx  # noqa: E402

from app import AppSettings, build_app  # noqa: E402
from app.serving import answers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARE_ERROR = "a shareable link must be created"
BUSY = 4  # busy-loop processes that saturate the CPU while the app starts
LIMIT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failed_self_check_still_serves_and_the_warm_up_starts_after_it(tmp_path, monkeypatch):
    import gradio.networking as net

    calls = []

    def hasty(url):  # what Gradio's check returns when its one HEAD misses its 3 s on a saturated CPU
        calls.append("self-check")
        return False

    monkeypatch.setattr(net, "url_ok", hasty)
    demo = build_app(AppSettings(output_root=tmp_path, backend="numpy"))
    start = demo.on_served
    assert start is not None and not demo.model_cache.kernels.ready.is_set()  # not started by build_app
    demo.on_served = lambda: (calls.append("warm-up"), start())
    try:
        demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=None, quiet=True)
        assert calls == ["self-check", "warm-up"]
        assert httpx.get(demo.local_url, timeout=30).status_code == 200
        assert demo.model_cache.kernels.ready.is_set()
    finally:
        demo.close()


def test_a_server_that_never_answers_is_not_taken_for_one():
    assert not answers(f"http://127.0.0.1:{free_port()}/", limit_s=1.0)


def test_python_m_app_serves_its_page_on_a_saturated_cpu(tmp_path):
    port, log = free_port(), tmp_path / "app.log"
    busy, app = [], None
    env = dict(os.environ, PYTHONUNBUFFERED="1", GRADIO_ANALYTICS_ENABLED="False")
    try:
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY)]
        with open(log, "wb") as out:
            app = subprocess.Popen([sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port),
                                    "--output-root", str(tmp_path / "out")],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        url, status, t0 = f"http://127.0.0.1:{port}/", None, time.monotonic()
        while time.monotonic() - t0 < LIMIT_S and app.poll() is None:
            try:
                status = httpx.get(url, timeout=10).status_code
                if status == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        waited, exited = time.monotonic() - t0, app.poll()
    finally:
        for p in [app, *busy]:
            if p is not None and p.poll() is None:
                p.kill()
        for p in [app, *busy]:
            if p is not None:
                p.wait(30)
    text = log.read_text(errors="replace")
    assert SHARE_ERROR not in text, text[-3000:]
    assert exited is None, f"the app exited ({exited}) after {waited:.0f} s:\n{text[-3000:]}"
    assert status == 200, f"no page after {waited:.0f} s (last status {status}):\n{text[-3000:]}"
