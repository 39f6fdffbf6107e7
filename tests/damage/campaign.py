"""Run the damage campaign (issue 18): every row of ``cases.py`` in a subprocess, each outcome classified.

    .venv/bin/python tests/damage/campaign.py [--kind K] [-k SUBSTRING] [--jobs N] [--json FILE] [--code DIR]
    PYTHONPATH=tests .venv/bin/python -m damage.campaign ...

tests/test_damage.py runs the same rows in one process (damage/inprocess.py), judged by ``classify`` as here.

``--code DIR`` points at the code under test (a folder holding toolkit/, app/ and data/; default this
checkout), e.g. an export of another commit. Each command runs as the ``moqe`` CLI (or an app handler
call) in a fresh subprocess with a 4 GB address-space limit and a time limit, under a Python audit hook
that logs every file it opens. Outcome classes:

  clear-error     rc 2 and stderr ends with one ``moqe ...: error: ...`` line, no traceback
  ok              rc 0 on an input the row calls valid
  accepted        rc 0 on an input the row calls bad (wrong output accepted)
  traceback       a Python traceback in the output, or a non-zero rc without the one-line form
  internal-error  rc 1 with the one-line form (an unexpected error caught at the edge)
  hang            still running at the time limit
  memory          MemoryError / failed allocation, or killed by SIGKILL (the address-space limit)
  crash           killed by another signal
  escape          a file outside what the command names was opened (audit log, access time), or the
                  command succeeded where the only valid copy of a file lies outside
  data-loss       a file the row protects changed or vanished
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.paths import kernel_cache as _kernel_cache

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from damage import cases as C
else:
    from . import cases as C

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
OUTCOMES = ("clear-error", "ok", "accepted", "traceback", "internal-error", "hang", "memory", "crash", "escape",
            "data-loss", "setup-error")
MEMORY_LIMIT = 4_000_000_000  # bytes of address space per command
NUMBA_CACHE = Path(os.environ.get("NUMBA_CACHE_DIR") or _kernel_cache())  # the toolkit's own (toolkit/paths.py)

# Runs first in every child: the address-space limit and an audit hook that logs each file opened from Python.
PRELUDE = r'''
import os, resource, sys
_limit = int(os.environ.get("DAMAGE_MEMORY_LIMIT") or 0)
if _limit:
    resource.setrlimit(resource.RLIMIT_AS, (_limit, _limit))
if os.environ.get("DAMAGE_OPEN_LOG"):
    def _install(fd, write=os.write, fspath=os.fspath, absolute=os.path.abspath, encode=os.fsencode):
        def hook(event, args):
            if event == "open" and args:
                try:
                    path = fspath(args[0])
                    if isinstance(path, (str, bytes)):
                        write(fd, encode(absolute(path)) + b"\n")
                except Exception:
                    pass
        sys.addaudithook(hook)
    _install(os.open(os.environ["DAMAGE_OPEN_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
'''
CLI_DRIVER = PRELUDE + "from toolkit.cli import main\nsys.exit(main())\n"
# An app handler called as the page calls it (damage.inprocess.call_app, shared with tests/test_damage.py).
APP_DRIVER = PRELUDE + r'''
import pickle
from damage.inprocess import call_app
with open(sys.argv[1], "rb") as f:
    sys.exit(call_app(pickle.load(f)))
'''
# Runs a command in a private mount namespace where every mount is read-only except the folders named
# before "--" (the case, its logs, the Numba cache): for rows that point ``--out`` at "/".
ISOLATE = r'''
import os, subprocess, sys
i = sys.argv.index("--")
keep, cmd = sys.argv[1:i], sys.argv[i + 1:]
for d in keep:
    subprocess.run(["mount", "--bind", d, d], check=True)
for m in sorted({line.split()[1] for line in open("/proc/self/mounts")}):
    if m not in keep:
        subprocess.run(["mount", "-o", "remount,bind,ro", m], stderr=subprocess.DEVNULL)
os.execvp(cmd[0], cmd)
'''
ERROR_LINE = re.compile(r"^moqe(?: [\w.-]+)*: error: \S")
BAR = re.compile(r"[^\r\n]*?\d+%\|[^|\r\n]*\|[^\]\r\n]*\]")  # a tqdm bar, up to its closing bracket
GLUED = re.compile(BAR.pattern + r" *moqe(?: [\w.-]+)*: error: ")  # an error printed on the line of a bar
MEMORY = re.compile(r"MemoryError|Unable to allocate|bad_alloc|Cannot allocate memory|out of memory", re.I)


@dataclass
class Proc:
    argv: list
    rc: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    stdout: str = ""
    stderr: str = ""


@dataclass
class Options:
    code: Path
    python: str
    timeout: float
    work: Path
    keep: bool = False
    isolate: bool = False  # mount namespaces available
    counter: list = field(default_factory=lambda: [0])
    lock: threading.Lock = field(default_factory=threading.Lock)


# ---- running one command --------------------------------------------------------------------------------------
def child_env(opts: Options, log: Path, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(opts.code), str(TESTS)]), NUMBA_CACHE_DIR=str(NUMBA_CACHE), GRADIO_ANALYTICS_ENABLED="False",
               DAMAGE_OPEN_LOG=str(log), DAMAGE_MEMORY_LIMIT=str(MEMORY_LIMIT))
    env.update(extra or {})
    return env


def execute(argv: list, cwd: Path, env: dict, timeout: float, logs: Path, tag: str, isolate_keep: list | None = None) -> Proc:
    """Run ``argv`` in its own session; stdout/stderr to files; kill the whole group at the time limit."""
    proc = Proc([os.fsdecode(a) if isinstance(a, bytes) else a for a in argv])
    cmd = list(argv)
    if isolate_keep is not None:
        cmd = ["unshare", "-m", "--propagation", "private", sys.executable, "-c", ISOLATE, *map(str, isolate_keep), "--", *cmd]
    out_path, err_path = logs / f"{tag}.stdout", logs / f"{tag}.stderr"
    t0 = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                proc.timed_out = True
                _kill_group(p.pid)
                pid, status, usage = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
    _kill_group(p.pid)  # leftovers of the session
    p.returncode = proc.rc = os.waitstatus_to_exitcode(status)
    proc.seconds = round(time.monotonic() - t0, 2)
    proc.peak_rss_mb = round(usage.ru_maxrss / 1024, 1)
    proc.stdout = out_path.read_bytes().decode("utf-8", "replace")
    proc.stderr = err_path.read_bytes().decode("utf-8", "replace")
    return proc


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def cli_argv(opts: Options, moqe_args: list) -> list:
    return [opts.python, "-c", CLI_DRIVER, *moqe_args]


# ---- what the runner checks around a command ------------------------------------------------------------------
def snapshot(paths: list[Path]) -> dict[str, str]:
    """sha256 of every file under ``paths`` (symlinks by target, other non-regular files by type)."""
    seen: dict[str, str] = {}

    def record(p: Path) -> None:
        if p.is_symlink():
            seen[str(p)] = "symlink -> " + os.readlink(p)
        elif p.is_file():
            seen[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.exists() and not p.is_dir():
            seen[str(p)] = "special"

    for root in paths:
        root = Path(root)
        if root.is_dir() and not root.is_symlink():
            for dirpath, dirs, files in os.walk(root):
                for name in files + [d for d in dirs if (Path(dirpath) / d).is_symlink()]:
                    record(Path(dirpath) / name)
        else:
            record(root)
    return seen


def arm(paths: list[Path], work: Path) -> dict[Path, int]:
    """Set the access time of planted outside files to 0: a read moves it (relatime updates an atime older
    than the mtime). Files not planted by the campaign (e.g. /etc/passwd) are left alone."""
    armed = {}
    for p in paths:
        if p.is_file() and Path(p).resolve().is_relative_to(work.resolve()):
            st = os.stat(p)
            os.utime(p, ns=(0, st.st_mtime_ns))
            armed[p] = os.stat(p).st_atime_ns
    return armed


def read_opened(log: Path) -> list[str]:
    """The paths the audit hook of PRELUDE logged."""
    return [os.fsdecode(line) for line in log.read_bytes().splitlines()] if log.exists() else []


def escape_evidence(ctx: C.Ctx, opened: list[str], armed: dict, final: Proc) -> list[str]:
    outside = {os.path.realpath(p): p for p in ctx.outside}
    found = []
    for path in opened:
        real = os.path.realpath(path)
        if real in outside and f"opened {real}" not in found:
            found.append(f"opened {real}")
    for p, atime in armed.items():
        if p.exists() and os.stat(p).st_atime_ns != atime and not any(str(os.path.realpath(p)) in f for f in found):
            found.append(f"read {p} (access time moved)")
    if ctx.outside_only and final.rc == 0 and not final.timed_out:
        found.append("succeeded although the only valid copy lies outside: " + ", ".join(map(str, ctx.outside)))
    return found


def useful_lines(text: str) -> list[str]:
    """The lines of ``text`` without tqdm bars (a bar and a message may share a line: the message is kept) and
    without the one-line note a cold kernel cache prints (``[compiling kernels ...]``)."""
    return [s for s in (BAR.sub("", seg).strip() for seg in re.split(r"[\r\n]+", text))
            if s and not s.startswith("[compiling kernels")]


def message_lines(stderr: str) -> list[str]:
    """What a user reads as the message: ``useful_lines`` less argparse's usage block before its error line."""
    lines = useful_lines(stderr)
    if lines and lines[0].startswith("usage: "):
        lines = lines[next((i for i, s in enumerate(lines) if ERROR_LINE.match(s)), 0):]
    return lines


def classify(case: C.Case, p: Proc, lost: list, escaped: list) -> tuple[str, str]:
    """-> (outcome class, one line saying why)."""
    text = p.stdout + "\n" + p.stderr
    err = useful_lines(p.stderr)
    last = err[-1] if err else ""
    if lost:
        return "data-loss", f"changed or gone: {', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''}"
    if escaped:
        return "escape", "; ".join(escaped)
    if p.timed_out:
        return "hang", f"still running after {p.seconds:.0f} s" + (f" (last: {last[:100]})" if last else "")
    memory = MEMORY.search(text)
    if "Traceback (most recent call last)" in text:
        return ("memory" if memory else "traceback"), last
    if p.rc < 0:
        sig = signal.Signals(-p.rc).name
        return ("memory" if memory or p.rc == -signal.SIGKILL else "crash"), f"killed by {sig}" + (f": {last}" if last else "")
    if p.rc == 0:
        out = useful_lines(p.stdout)
        return ("ok" if "ok" in case.expect else "accepted"), "rc 0: " + (out[0][:120] if out else last)
    if ERROR_LINE.match(last):
        if p.rc == 2:
            return "clear-error", last
        if p.rc == 1:
            return ("memory" if memory else "internal-error"), last
    return "traceback", f"rc {p.rc} without the one-line form: {last}"


# ---- one case -------------------------------------------------------------------------------------------------
def run_case(case: C.Case, fx: C.Fixtures, opts: Options) -> dict:
    key = f"{case.kind}-{re.sub(r'[^A-Za-z0-9_.^-]', '_', case.id)}"
    case_dir, logs = opts.work / "cases" / key, opts.work / "logs" / key
    case_dir.mkdir(parents=True)
    logs.mkdir(parents=True)
    result = {"kind": case.kind, "id": case.id, "expect": list(case.expect)}
    ctx = C.Ctx(case_dir, fx)
    try:
        try:
            run = case.setup(ctx)
        except Exception as e:
            result.update(outcome="setup-error", good=False, summary=f"{type(e).__name__}: {e}",
                          detail=traceback.format_exc())
            return result
        before = snapshot(ctx.protected)
        armed = arm(ctx.outside, opts.work)
        log = logs / "opened.log"
        if run.app is not None:
            (logs / "call.pkl").write_bytes(pickle.dumps(run.app))
            argv = [opts.python, "-c", APP_DRIVER, str(logs / "call.pkl")]
        else:
            argv = cli_argv(opts, run.argv)
        keep = [case_dir, logs, NUMBA_CACHE] if run.isolate and opts.isolate else None
        first = execute(argv, case_dir, child_env(opts, log, run.env), opts.timeout, logs, "run", keep)
        final = first
        if run.then is not None and not first.timed_out:
            final = execute(cli_argv(opts, run.then), case_dir, child_env(opts, log), opts.timeout, logs, "then")
        lost = sorted(k for k, v in before.items() if snapshot([Path(k)]).get(k) != v) + ctx.leftovers()
        escaped = escape_evidence(ctx, read_opened(log), armed, final)
        outcome, summary = classify(case, final, lost, escaped)
        summary = summary.replace(f"{case_dir}/", "").replace(str(opts.work), "WORK")
        result.update(outcome=outcome, good=outcome in case.expect, summary=summary,
                      error_on_bar_line=bool(GLUED.search(final.stderr)),
                      argv=first.argv[3:] if run.app is None else ["<app>", run.app["handler"]],
                      app_args=repr(run.app["args"])[:300] if run.app else None,
                      rc=final.rc, seconds=round(first.seconds + (final.seconds if final is not first else 0), 2),
                      peak_rss_mb=max(first.peak_rss_mb, final.peak_rss_mb),
                      stderr_tail=final.stderr[-3000:], stdout_tail=final.stdout[-500:],
                      lost=lost, escape=escaped)
        if final is not first:
            result["first"] = {"rc": first.rc, "timed_out": first.timed_out, "stderr_tail": first.stderr[-1000:]}
        return result
    finally:
        ctx.release()
        if not opts.keep:
            shutil.rmtree(case_dir, ignore_errors=True)
            shutil.rmtree(logs, ignore_errors=True)


# ---- fixtures ------------------------------------------------------------------------------------------------
def build_fixtures(root: Path, code: Path, quantize) -> C.Fixtures:
    """The tiny checkpoints (written in this process by tests/tiny_model.py, with the toolkit it imports) and
    bundles: ``quantize(args)`` runs ``moqe quantize ARGS`` with the code under test."""
    import tiny_model

    data = code / "data" / "model"

    def tiny(name: str, **changes) -> Path:
        d = root / name
        tiny_model.write(d, {**tiny_model.CONFIG, "vocab_size": 8192, **changes})
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(data / f, d / f)
        return d

    fx = C.Fixtures(code=code, tiny=tiny("tiny"), tiny8=tiny("tiny8", num_local_experts=8),
                    tiny_v64=tiny("tiny_v64", vocab_size=64), bundle=root / "bundle", sharded=root / "sharded",
                    bundle_int2=root / "bundle_int2")
    for out, extra in ((fx.bundle, ["--experts", "int4"]), (fx.sharded, ["--experts", "int4", "--shard-size", "20000"]),
                       (fx.bundle_int2, ["--experts", "int2"])):
        quantize(["--model", str(fx.tiny), *extra, "--out", str(out)])
    return fx


def subprocess_fixtures(opts: Options) -> C.Fixtures:
    """build_fixtures with every bundle written by a ``moqe quantize`` subprocess of the code under test."""
    sys.path[:0] = [str(opts.code), str(TESTS)]
    logs = opts.work / "logs" / "fixtures"
    logs.mkdir(parents=True)

    def quantize(args: list) -> None:
        p = execute(cli_argv(opts, ["quantize", *args]), opts.work, child_env(opts, logs / "opened.log"), 600, logs,
                    Path(args[-1]).name)
        if p.rc != 0:
            sys.exit(f"damage campaign: cannot build the fixture {args[-1]} with the code under test:\n{p.stderr[-3000:]}")

    return build_fixtures(opts.work / "fixtures", opts.code, quantize)


def isolation_available() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], stderr=subprocess.DEVNULL).returncode == 0


# ---- report ---------------------------------------------------------------------------------------------------
def counts(results: list[dict]) -> dict:
    table: dict[str, dict] = {}
    for r in results:
        row = table.setdefault(r["kind"], {"rows": 0, "good": 0, **{o: 0 for o in OUTCOMES}})
        row["rows"] += 1
        row["good"] += bool(r["good"])
        row[r["outcome"]] += 1
    total = {"rows": 0, "good": 0, **{o: 0 for o in OUTCOMES}}
    for row in table.values():
        for k, v in row.items():
            total[k] += v
    table["total"] = total
    return table


def render(results: list[dict], meta: dict) -> str:
    table = counts(results)
    cols = ["rows", "good"] + [o for o in OUTCOMES if o != "setup-error" or table["total"]["setup-error"]]
    kinds = [k for k in list(tables()) + ["total"] if k in table]
    width = {c: max(len(c), 4) for c in cols}
    lines = [f"damage campaign: code {meta['code']}, {meta['cases']} cases, {meta['jobs']} jobs, timeout {meta['timeout']:g} s, "
             f"address space {MEMORY_LIMIT / 1e9:g} GB, {meta['seconds']:.0f} s", ""]
    lines.append(f"{'kind':<11}" + "  ".join(f"{c:>{width[c]}}" for c in cols))
    for k in kinds:
        if k == "total":
            lines.append("-" * len(lines[-1]))
        lines.append(f"{k:<11}" + "  ".join(f"{table[k][c]:>{width[c]}}" for c in cols))
    glued = sum(1 for r in results if r.get("error_on_bar_line") and r["outcome"] == "clear-error")
    if glued:
        lines += ["", f"({glued} of the clear errors are printed on the line of a progress bar, which is drawn again after them)"]
    bad = [r for r in results if not r["good"]]
    lines += ["", f"not good ({len(bad)}):"]
    for kind in kinds:
        for r in (r for r in bad if r["kind"] == kind):
            lines.append(f"  {r['kind']}/{r['id']}: {r['outcome']} (good: {'|'.join(r['expect'])}) - {r['summary'][:160]}")
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------------------------
def tables() -> dict:
    """The hand-written tables (cases.py) and issue 29's, generated from the CLI's declared arguments (targets.py,
    which imports the toolkit under test to read its parser)."""
    if __package__ in (None, ""):
        from damage import targets as T
    else:
        from . import targets as T
    return {**C.TABLES, "write": T.WRITE, "read": T.READ, "finding": T.FINDINGS}


def select(kinds: list | None, subs: list | None) -> list[C.Case]:
    chosen = [c for t in tables().values() for c in t if not kinds or c.kind in kinds]
    if subs:
        chosen = [c for c in chosen if any(s in f"{c.kind}/{c.id}" for s in subs)]
    return chosen


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(prog="damage.campaign", description=__doc__.split("\n")[0])
    ap.add_argument("--kind", action="append", choices=list(C.TABLES) + ["write", "read", "finding"], help="run only this input kind (repeatable)")
    ap.add_argument("-k", action="append", metavar="SUBSTRING", help="run only rows whose kind/id contains this (repeatable)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run in parallel (default 2)")
    ap.add_argument("--timeout", type=float, default=60, help="seconds per command (default 60)")
    ap.add_argument("--json", metavar="FILE", help="write every result (and the counts) as JSON")
    ap.add_argument("--code", type=Path, default=REPO, help="root of the code under test (default: this checkout)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the commands (default: this one)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (cases, logs, fixtures)")
    ap.add_argument("--list", action="store_true", help="list the selected rows and exit")
    args = ap.parse_args(argv)

    chosen = select(args.kind, args.k)
    if args.list:
        for c in chosen:
            print(f"{c.kind:<11}{c.id:<45}{'|'.join(c.expect)}")
        print(f"{len(chosen)} rows")
        return 0
    if not chosen:
        print("no rows selected", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="moqe-damage-"))
    opts = Options(code=args.code.resolve(), python=args.python, timeout=args.timeout, work=work, keep=args.keep,
                   isolate=isolation_available())
    t0 = time.monotonic()
    try:
        print(f"building fixtures in {work} with the code in {opts.code} ...", file=sys.stderr, flush=True)
        fx = subprocess_fixtures(opts)
        if not opts.isolate:
            print("note: no mount namespace here; rows that write to / run unisolated", file=sys.stderr)
        results = []

        def one(case: C.Case) -> dict:
            r = run_case(case, fx, opts)
            with opts.lock:
                opts.counter[0] += 1
                print(f"[{opts.counter[0]:>3}/{len(chosen)}] {case.kind}/{case.id}: {r['outcome']}"
                      f"{'' if r['good'] else '  <-- not good'} ({r.get('seconds', 0):.1f} s)", file=sys.stderr, flush=True)
            return r

        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(one, chosen))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    meta = {"code": str(opts.code), "cases": len(chosen), "jobs": args.jobs, "timeout": args.timeout,
            "memory_limit": MEMORY_LIMIT, "seconds": time.monotonic() - t0, "isolation": opts.isolate}
    text = render(results, meta)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "counts": counts(results), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
