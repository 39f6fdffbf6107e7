"""``moqe serve``: an OpenAI-compatible HTTP server over one model, with continuous batching and expert telemetry.

- :mod:`.engine`: the engine thread, slots of the KV cache, the scheduling policy, per-request sampling;
- :mod:`.api`: the FastAPI app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``);
- :mod:`.protocol`: the request bodies; :mod:`.chat`: chat templates; :mod:`.detok`: streamed text and stop strings;
- :mod:`.metrics`: Prometheus metrics, per-layer expert routing counts included.
"""
from __future__ import annotations

import threading
import time

from .engine import Engine, Event, GenParams, QueueFull

__all__ = ["Engine", "Event", "GenParams", "QueueFull", "Server", "make_server"]


class Server:
    """A model served over HTTP: ``Server(model, tok, name, ...)`` then ``run()`` (blocking) or ``start()`` (a
    background thread, for tests and notebooks; ``url`` once started; ``stop()``)."""

    def __init__(self, model, tok, name: str, chat_template=None, host: str = "127.0.0.1", port: int = 8000,
                 metrics: bool = True, log_level: str = "warning", **engine_kw):
        import uvicorn

        from .api import build_app
        from .metrics import Metrics

        self.metrics = Metrics(name) if metrics else None
        self.engine = Engine(model, tok, telemetry=self.metrics, **engine_kw)
        if self.metrics is not None:
            self.metrics.engine = self.engine
        self.app = build_app(self.engine, tok, name, chat_template, self.metrics)
        config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = None

    @property
    def url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def run(self) -> None:
        try:
            self.server.run()
        finally:
            self.engine.close()

    def start(self, timeout: float = 60.0) -> "Server":
        self._thread = threading.Thread(target=self.server.run, name="moqe-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.engine.close()
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self.engine.close()


def make_server(model_path: str, backend: str = "numba", policy=None, kv_cache=None, placement=None,
                name: str | None = None, **kw) -> Server:
    """Load ``model_path`` (a checkpoint folder, UQFF bundle or GGUF file) and build its server."""
    from pathlib import Path

    from ..load import load_model
    from .chat import load_chat_template

    template = load_chat_template(model_path)
    model, tok = load_model(model_path, backend=backend, policy=policy, kv_cache=kv_cache, placement=placement)
    return Server(model, tok, name or Path(model_path).name, template, **kw)
