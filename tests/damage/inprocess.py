"""Run damage cases in this process (tests/test_damage.py), judged as the campaign judges a subprocess.

A command is ``toolkit.cli.main(argv)`` or an app handler called through ``handlers.friendly`` (``call_app``,
also the campaign's app driver), with stdout and stderr captured and the working directory set to the case
folder, under:

- a time limit (SIGALRM raises :class:`Stop` into the code; an open() blocked on a FIFO inside native code,
  which does not return for a signal, is released by opening the case's FIFOs once the limit has passed),
- an address-space limit (``MEMORY_HEADROOM`` above what the process holds),
- an audit hook that records every file opened from Python and stops any write outside the case folder
  (``WRITABLE`` aside) before it happens: the ``--out /`` rows (``Run.isolate``) and any regression that
  would write elsewhere damage nothing.

Rows whose command kills itself (``Run.env``: an interrupted save) run that command in a child process.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import os
import resource
import signal
import stat
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from toolkit.paths import kernel_cache

from . import campaign as K
from . import cases as C

TIMEOUT = 30.0  # seconds per command
MEMORY_HEADROOM = 4_000_000_000  # bytes of address space a command may add
# Where a command may write besides its case folder (and __pycache__): the kernel caches, /dev/null.
WRITABLE = (kernel_cache(), os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy", "/dev/null")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
WRITE_EVENTS = {"os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "shutil.rmtree": (0,),
                "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.utime": (0,)}


class Stop(BaseException):
    """Raised into the code under test (time limit, write guard); not an Exception, so no catch-all there eats it."""


class _Audit:
    opened: list | None = None  # while a command runs: every path it opens
    writable: list = []  # the only roots a command may write under
    stopped: list = []  # why a write was stopped
    installed = False


def _hook(event: str, args: tuple) -> None:
    if _Audit.opened is None or not args or not (event == "open" or event in WRITE_EVENTS):
        return
    if event == "open":
        writes = [args[0]] if len(args) > 2 and (args[2] or 0) & WRITE_FLAGS else []
    else:
        writes = [args[i] for i in WRITE_EVENTS[event] if i < len(args)]
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _Audit.opened.append(os.path.abspath(os.fsdecode(args[0])))
    for p in writes:
        if isinstance(p, (str, bytes, os.PathLike)):
            real = os.path.realpath(os.fsdecode(p))
            if event == "os.mkdir" and os.path.lexists(real):
                continue  # fails with EEXIST: harmless
            if "__pycache__" not in real and not any(real == r or real.startswith(r + os.sep) for r in _Audit.writable):
                _Audit.stopped.append(f"wrote outside the case folder: {event} {real}")
                raise Stop(_Audit.stopped[-1])


@contextlib.contextmanager
def _watched(opened: list, writable: list):
    if not _Audit.installed:
        sys.addaudithook(_hook)
        _Audit.installed = True
    _Audit.opened, _Audit.writable, _Audit.stopped = opened, writable, []
    try:
        yield _Audit.stopped
    finally:
        _Audit.opened = None


# After $0 seconds, open each FIFO read-write and close it: a reader blocked in open() returns and reads EOF.
# A process, not a thread: native code may hold the GIL while it blocks.
RELEASE_FIFOS = 'sleep "$0"; for f; do exec 3<>"$f"; exec 3>&-; done'


@contextlib.contextmanager
def _limited(folder: Path, seconds: float):
    """Time and memory bounds around a command; yields a list that holds True once the time ran out."""
    expired = []

    def alarm(signum, frame):
        if not expired:
            expired.append(True)
            raise Stop(f"still running after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    fifos = [str(p) for p in folder.rglob("*") if stat.S_ISFIFO(p.lstat().st_mode)]
    release = subprocess.Popen(["sh", "-c", RELEASE_FIFOS, str(seconds + 1), *fifos]) if fifos else None
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * resource.getpagesize()
    cap = min(x for x in (held + MEMORY_HEADROOM, soft, hard) if x != resource.RLIM_INFINITY)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield expired
    finally:
        expired.append(False)  # an alarm from here on is ignored
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if release is not None:
            release.kill()
            release.wait()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def _inside(folder: Path):
    """The case folder as working directory, crash reports written into it."""
    cwd, crash = os.getcwd(), os.environ.get("MOQE_CRASH_DIR")
    os.chdir(folder)
    os.environ["MOQE_CRASH_DIR"] = str(folder / ".crash")
    try:
        yield
    finally:
        os.chdir(cwd)
        if crash is None:
            os.environ.pop("MOQE_CRASH_DIR", None)
        else:
            os.environ["MOQE_CRASH_DIR"] = crash


def call_cli(argv: list) -> int:
    """``moqe ARGV`` (bytes decoded as Python decodes sys.argv); an uncaught exception prints its traceback, rc 1."""
    from toolkit.cli import main

    try:
        return main([os.fsdecode(a) for a in argv])
    except SystemExit as e:  # argparse
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - as the interpreter would report it
        traceback.print_exc()
        return 1


def call_app(call: dict) -> int:
    """An app handler called as the page calls it; a gr.Error becomes the CLI's one-line form: rc 2 for a
    message, rc 1 for an "internal error" (the handler's own catch-all)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr
    from app import handlers
    from app.models import ModelCache
    from app.ui import AppSettings

    settings = AppSettings(**call["settings"])
    cache = ModelCache(settings.cache_size, settings.backend)
    try:
        out = handlers.friendly(getattr(handlers, call["handler"]))(settings, cache, *call["args"])
        if inspect.isgenerator(out):
            out = list(out)[-1]
    except gr.Error as e:
        msg = " ".join(str(getattr(e, "message", e)).split())
        print(f"moqe app: error: {msg}", file=sys.stderr)
        return 1 if msg.startswith("internal error") else 2
    except Exception:  # noqa: BLE001 - as the interpreter would report it
        traceback.print_exc()
        return 1
    print(repr(out)[:500])
    return 0


def command(ctx: C.Ctx, run: C.Run, seconds: float = TIMEOUT) -> tuple[K.Proc, list, list]:
    """Run one command of a case here: -> (its Proc, the paths it opened, the writes the guard stopped)."""
    proc = K.Proc(["<app>", run.app["handler"]] if run.app is not None else [os.fsdecode(a) for a in run.argv])
    out, err, opened = io.StringIO(), io.StringIO(), []
    writable = [os.path.realpath(p) for p in (ctx.dir, *WRITABLE) if p]
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _inside(ctx.dir), \
            _watched(opened, writable) as stopped:
        try:
            with _limited(ctx.dir, seconds) as expired:
                proc.rc = call_app(run.app) if run.app is not None else call_cli(run.argv)
        except Stop:
            proc.rc, proc.timed_out = 1, bool(expired and expired[0])
    proc.seconds, proc.stdout, proc.stderr = round(time.monotonic() - t0, 2), out.getvalue(), err.getvalue()
    return proc, opened, list(stopped)


def child_command(ctx: C.Ctx, run: C.Run, code: Path, seconds: float = TIMEOUT) -> tuple[K.Proc, list, list]:
    """As :func:`command`, in a child process (the campaign's CLI driver)."""
    logs = ctx.dir / ".logs"
    logs.mkdir(exist_ok=True)
    opts = K.Options(code=code, python=sys.executable, timeout=seconds, work=ctx.dir)
    proc = K.execute(K.cli_argv(opts, run.argv), ctx.dir, K.child_env(opts, logs / "opened.log", run.env), seconds, logs, "run")
    return proc, K.read_opened(logs / "opened.log"), []


@dataclass
class Result:
    outcome: str
    summary: str
    proc: K.Proc


def code_under_test() -> Path:
    """The root (toolkit/, app/, data/) of the toolkit this process imports."""
    import toolkit

    return Path(toolkit.__file__).resolve().parents[1]


def build_fixtures(root: Path) -> C.Fixtures:
    """The campaign's fixtures, the bundles written by ``moqe quantize`` in this process."""
    def quantize(args: list) -> None:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = call_cli(["quantize", *args])
        assert rc == 0, f"cannot build a damage fixture with moqe quantize {args}:\n{err.getvalue()[-3000:]}"

    # the app's modules are imported here, not inside the first app case (the audit hook records those opens)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import app.handlers  # noqa: F401
    return K.build_fixtures(root, code_under_test(), quantize)


def run_case(case: C.Case, fx: C.Fixtures, folder: Path, seconds: float = TIMEOUT) -> Result:
    """Set up ``case`` in ``folder``, run its command(s), check protected and outside files: -> the outcome."""
    ctx = C.Ctx(folder, fx)
    try:
        run = case.setup(ctx)
        before = K.snapshot(ctx.protected)
        armed = K.arm(ctx.outside, ctx.dir)
        first, opened, stopped = child_command(ctx, run, fx.code, seconds) if run.env else command(ctx, run, seconds)
        final = first
        if run.then is not None and not first.timed_out:
            final, more, also = command(ctx, C.Run(run.then), seconds)
            opened, stopped = opened + more, stopped + also
        lost = sorted(k for k, v in before.items() if K.snapshot([Path(k)]).get(k) != v) + ctx.leftovers()
        escaped = stopped + K.escape_evidence(ctx, opened, armed, final)
        outcome, summary = K.classify(case, final, lost, escaped)
        return Result(outcome, summary.replace(f"{ctx.dir}/", ""), final)
    finally:
        ctx.release()
