"""Kernel warm-up for the app: compile (or load from the cache) every kernel the page can ask for, in a
background thread started once the app's server is up (``app/serving.py``), one line per kernel family on
the terminal, **without making a request wait for it**.

- Order: what the page asks first. The families of the default configurations (in the order of their rows)
  come first, then every other family, then the compiled one-token decode steps (the defaults' first).
- A request never waits for the warm-up to finish. While one is being served (``serving()``), the warm-up
  pauses before its next forward pass; the request compiles what it uses itself, once (the process and the
  disk cache share it with the warm-up). So a request waits at most for one forward pass of the warm-up.
- The models run the compiled decode step only once it is compiled (``compiled_decode = "cached"``): a first
  request never pays its compilation (seconds) to save milliseconds; the warm-up compiles the steps last.

The page shows the state (``status_line``) and exposes it at ``/kernel_status``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

from toolkit.crash import one_line
from toolkit.warmup import FAMILIES_ALL, KV_ALL, POLICIES, Warmer, step_line, warm_steps

log = logging.getLogger("app")
WAITING = "Preparing kernels in the background (first run only)"


def ordered_steps(defaults=(), formats=FAMILIES_ALL, kv_types=KV_ALL) -> list[tuple[str, str]]:
    """``warm_steps`` (with the compiled decode steps), reordered so that the families the configurations
    ``defaults`` [(format, policy, KV type)] use come first, in their order: the core step, then per
    configuration its KV cache type and its (policy, format), then the rest; the decode steps of the
    defaults lead the decode steps."""
    from toolkit.formats import get_format

    steps = warm_steps(formats, kv_types, POLICIES, decode=True)
    first = [("core", "f32")]
    for fmt, policy, kv in defaults:
        name = get_format(fmt).name if fmt not in ("none", None) else None
        first += [("kv", kv)] if kv != "f32" else []
        first += [("policy", f"{policy}:{name}")] if name else []
    first += [("decode", f"moqe:{get_format(f).name}:{kv}") for f, p, kv in defaults
              if f not in ("none", None) and kv != "f32" and p == "moqe"]
    first = [st for st in dict.fromkeys(first) if st in steps]
    families = [st for st in first if st[0] != "decode"]
    rest = [st for st in steps if st not in first]
    return (families + [st for st in rest if st[0] != "decode"] + [st for st in first if st[0] == "decode"]
            + [st for st in rest if st[0] == "decode"])


class KernelWarmup:
    def __init__(self, backend: str = "numba", formats=FAMILIES_ALL, kv_types=KV_ALL, lock=None, echo=print,
                 defaults=(), runner=Warmer):
        self.backend, self.formats, self.kv_types = backend, tuple(formats), tuple(kv_types)
        self.steps = ordered_steps(defaults, self.formats, self.kv_types)
        self.total = len(self.steps)
        self.done, self.compiled, self.seconds, self.error = 0, 0, 0.0, None
        self.ready = threading.Event()
        self._lock, self._echo, self._runner = lock, echo, runner
        self._thread: threading.Thread | None = None
        self._serving = 0  # requests being served: the warm-up pauses while there is one
        self._idle = threading.Condition()

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

    @contextlib.contextmanager
    def serving(self):
        """Held by a request while it is served: the warm-up pauses before its next forward pass."""
        with self._idle:
            self._serving += 1
        try:
            yield
        finally:
            with self._idle:
                self._serving -= 1
                self._idle.notify_all()

    @contextlib.contextmanager
    def _gate(self):
        """Around each forward pass of the warm-up: wait until no request is being served, then hold the
        compute lock (Numba's thread pool serves one caller at a time)."""
        with self._idle:
            self._idle.wait_for(lambda: self._serving == 0)
        with self._lock if self._lock is not None else contextlib.nullcontext():
            yield

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            with self._runner(self.backend, gate=self._gate) as w:
                for st in self.steps:
                    label, seconds, compiled = w.step(st)
                    self.done += 1
                    self.compiled += compiled
                    if self._echo is not None:
                        self._echo(f"app: {step_line(label, seconds, compiled)}  [{self.done}/{self.total}]")
        except Exception as e:  # noqa: BLE001 - a failed warm-up must not stop the app: kernels compile on use
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
            return (f"⏳ {WAITING}: {self.done}/{self.total} kernel families. A request does not wait for them: "
                    f"it compiles what it uses the first time.")
        if self.error:
            return f"Kernel warm-up failed ({self.error}); kernels compile on first use."
        return (f"Kernels ready ({self.compiled} compiled, {self.seconds:.1f} s)" if self.compiled
                else f"Kernels ready (from the cache, {self.seconds:.1f} s)")

    def first_use(self) -> str:
        """What a request says while the warm-up is still running (it may compile its own kernels)."""
        return "" if self.ready.is_set() else "⏳ compiling the kernels this configuration uses (first run only)..."
