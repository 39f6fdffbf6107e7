"""The app's ``gr.Blocks``: it starts the kernel warm-up only once its server is up, and it keeps serving when
Gradio's start-up self-check is too hasty for a busy machine.

Gradio's ``launch`` ends with a self-check (``gradio.networking.url_ok``): one HEAD request to the local URL
with a 3 s timeout, where a timeout is final; when it fails, ``launch`` raises "When localhost is not
accessible, a shareable link must be created" although its server is running. The warm-up compiles Numba
kernels in a thread of this process (holding the GIL and a core), so started before ``launch`` it can make
that one request miss its 3 s on a saturated CPU. Here ``launch`` runs Gradio's with ``prevent_thread_lock``,
starts the warm-up after it returns, then blocks the way Gradio would have. And when the self-check fails
all the same (the machine is busy for other reasons), the server is checked again, patiently: if it answers,
the app serves; only a server that never answers is the error it was.
"""
from __future__ import annotations

import inspect
import os
import sys
import threading
import time

import gradio as gr

SELF_CHECK = "When localhost is not accessible"  # the start of the error Gradio's self-check raises
PATIENCE_S = 120.0  # how long a server that failed Gradio's self-check may take to answer ours
ANSWERED = (200, 401, 301, 302, 303, 307, 308)  # what Gradio's own check counts as an answer (auth, redirects)


def answers(url: str, limit_s: float = PATIENCE_S) -> bool:
    """Whether ``url`` answers a HEAD request within ``limit_s`` (retrying; one slow reply is not a failure)."""
    import httpx

    deadline = time.monotonic() + limit_s
    while True:
        left = deadline - time.monotonic()
        try:
            if httpx.head(url, timeout=max(1.0, min(30.0, left)), verify=False).status_code in ANSWERED:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


class App(gr.Blocks):
    """``gr.Blocks`` whose ``launch`` starts ``on_served`` (the kernel warm-up) once the server is up."""

    on_served = None  # a callable, run once after the server is up
    _served_lock = threading.Lock()

    def launch(self, *args, **kwargs):
        a = inspect.signature(gr.Blocks.launch).bind(self, *args, **kwargs).arguments
        a.pop("self")
        debug, free = a.pop("debug", False), a.pop("prevent_thread_lock", False)
        env_debug = os.getenv("GRADIO_DEBUG", "0") == "1"  # makes Gradio's launch block: warm up from a thread
        # block as Gradio's launch would have: debug, or a script's main thread (not an interactive session)
        block = debug or env_debug or (not free and not bool(getattr(sys, "ps1", sys.flags.interactive)))
        if env_debug:
            threading.Thread(target=self._serve_when_answering, name="app-launch", daemon=True).start()
        try:
            result = super().launch(**a, debug=False, prevent_thread_lock=True)
        except ValueError as e:
            if not (str(e).startswith(SELF_CHECK) and self.is_running and self.local_url):
                raise
            if not answers(self.local_url):
                raise
            print(f"app: the server took longer than Gradio's start-up check allows (a busy machine?); it answers "
                  f"now: serving on {self.local_url}", file=sys.stderr, flush=True)
            result = (self.server_app, self.local_url, None)
        self._served()
        if block:
            self.block_thread()
        return result

    def _serve_when_answering(self) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while not (self.is_running and self.local_url):
            if time.monotonic() > deadline:  # the server never came up: launch raised its error
                return
            time.sleep(0.2)
        if answers(self.local_url):
            self._served()

    def _served(self) -> None:
        with self._served_lock:
            start, self.on_served = self.on_served, None
        if start is not None:
            start()
