"""Kernel warm-up for the app: compile (or load from the cache) every kernel the page can ask for, in a
background thread started once the app's server is up (``app/serving.py``), one line per kernel family on
the terminal.

The page shows the state (``status_line``) and exposes it at ``/kernel_status``; a request that arrives
before the warm-up is done waits, and says "preparing kernels (first run only)" while it does.
"""
from __future__ import annotations

import logging
import threading
import time

from toolkit.crash import one_line
from toolkit.warmup import FAMILIES_ALL, KV_ALL, POLICIES, warm, warm_steps

log = logging.getLogger("app")
WAITING = "Preparing kernels (first run only)"


class KernelWarmup:
    def __init__(self, backend: str = "numba", formats=FAMILIES_ALL, kv_types=KV_ALL, lock=None, echo=print):
        self.backend, self.formats, self.kv_types = backend, tuple(formats), tuple(kv_types)
        self.total = len(warm_steps(self.formats, self.kv_types, POLICIES, decode=False))  # warm's steps
        self.done, self.compiled, self.seconds, self.error = 0, 0, 0.0, None
        self.ready = threading.Event()
        self._lock, self._echo = lock, echo
        self._thread: threading.Thread | None = None

    def start(self) -> "KernelWarmup":
        """Start compiling in a background thread (once: a second call does nothing)."""
        if self._thread is not None or self.ready.is_set():
            return self
        if self.backend != "numba":
            self.ready.set()
            return self
        self._thread = threading.Thread(target=self._run, name="kernel-warmup", daemon=True)
        self._thread.start()
        return self

    def _line(self, line: str) -> None:
        self.done += 1
        if self._echo is not None:
            self._echo(f"app: {line}  [{self.done}/{self.total}]")

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._lock is not None:  # Numba's thread pool serves one caller at a time: requests wait here
                with self._lock:
                    report = warm(self.formats, self.kv_types, backend=self.backend, log=self._line, decode=False)
            else:
                report = warm(self.formats, self.kv_types, backend=self.backend, log=self._line, decode=False)
            self.compiled = report.compiled
        except Exception as e:  # noqa: BLE001 - a failed warm-up must not keep requests waiting forever
            self.error = f"{type(e).__name__}: {one_line(e, 300)}"
            log.error("kernel warm-up failed (%s); kernels compile on first use instead", self.error)
        finally:
            self.seconds = time.perf_counter() - t0
            self.ready.set()
            if self._echo is not None:
                self._echo(f"app: kernels ready in {self.seconds:.1f} s ({self.compiled} compiled)")

    def wait(self, timeout: float | None = None) -> bool:
        return self.ready.wait(timeout)

    def status(self) -> dict:
        return {"ready": self.ready.is_set(), "done": self.done, "total": self.total, "compiled": self.compiled,
                "seconds": round(self.seconds, 2), "error": self.error, "line": self.status_line()}

    def status_line(self) -> str:
        if not self.ready.is_set():
            return f"⏳ {WAITING}: {self.done}/{self.total} kernel families"
        if self.error:
            return f"Kernel warm-up failed ({self.error}); kernels compile on first use."
        return (f"Kernels ready ({self.compiled} compiled, {self.seconds:.1f} s)" if self.compiled
                else f"Kernels ready (from the cache, {self.seconds:.1f} s)")

    def waiting_message(self) -> str:
        return f"{WAITING}: {self.done}/{self.total} kernel families done..."
