"""``python -m toolkit.bench coldstart``: the first five minutes on this machine, with an empty kernel cache.

In order, each in its own process and its own empty kernel cache (a temporary ``NUMBA_CACHE_DIR`` and
``MOQE_EMU_CACHE``, removed at the end), from the checkout given by ``--repo`` (default: this one):
1. ``python -m app``: seconds until its page is served;
2. the page's default comparison (its first two rows, the default prompt, 48 new tokens) through
   ``gradio_client``, sent as soon as the page is served: seconds until it has answered;
3. the app's kernel warm-up: its total seconds and kernels compiled (``/kernel_status``);
4. ``moqe generate --experts int4 --kv-cache q8_0`` (32 new tokens) with the app's cache: kernels it compiled
   (its own timing line says; none is the goal);
5. the same command in a new empty cache: wall seconds of the whole process, compilation included, and the
   path its decode took (``--verbose``: a first run decodes on the staged ops and leaves the compiled decode
   step to a background build, ``toolkit/cpu/_detached.py``);
6. once that build is done (its lock free), the same command again: wall seconds and its decode path.
``--cli-only`` runs 5 and 6 alone. Each figure is one run; compare a before and an after measured in one
session, one after the other.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cpu._detached import wait_done
from .timing import print_table

REPO = Path(__file__).resolve().parents[2]
PROMPT = "It is a truth universally acknowledged"
CLI = ["-m", "toolkit", "generate", "--experts", "int4", "--kv-cache", "q8_0", "--prompt", PROMPT, "--max-new-tokens", "32",
       "--verbose"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache: Path) -> dict:
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache / "numba"), "MOQE_EMU_CACHE": str(cache / "emu"),
            "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}


def app_figures(repo: Path, python: str, cache: Path, log: Path, limit_s: float) -> dict:
    from gradio_client import Client

    from app.serving import answers
    from app.ui import DEFAULT_SLOTS

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    with open(log, "w") as out:
        t0 = time.monotonic()
        app = subprocess.Popen([python, "-m", "app", "--port", str(port)], cwd=repo, env=_env(cache), stdout=out,
                               stderr=subprocess.STDOUT)
        try:
            if not answers(url, limit_s):
                raise RuntimeError(f"the app did not serve {url} within {limit_s:.0f} s; its output:\n"
                                   f"{log.read_text()[-3000:]}")
            served = time.monotonic() - t0
            client = Client(url, verbose=False)
            rows = [x for row in DEFAULT_SLOTS for x in row]
            t1 = time.monotonic()
            texts = client.predict(2, *rows, PROMPT, 48, 0.7, 1234, api_name="/compare")[:2]
            first = time.monotonic() - t1
            while not (st := client.predict(api_name="/kernel_status"))["ready"]:
                if time.monotonic() - t0 > limit_s:
                    raise RuntimeError(f"the warm-up was not done within {limit_s:.0f} s")
                time.sleep(1.0)
        finally:
            app.terminate()
            app.wait(30)
    if not all(texts):
        raise RuntimeError(f"the default comparison gave an empty text: {texts}")
    return {"page served s": round(served, 1), "first default comparison s": round(first, 1),
            "warm-up s": st["seconds"], "warm-up kernels compiled": st["compiled"]}


def cli_run(repo: Path, python: str, cache: Path) -> tuple[float, str, str]:
    """(wall seconds, its timing line, its decode path) of one ``moqe generate`` process."""
    t0 = time.monotonic()
    r = subprocess.run([python, *CLI], cwd=repo, env=_env(cache), capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode:
        raise RuntimeError(f"moqe generate failed: {r.stderr[-2000:]}")
    lines = r.stderr.strip().splitlines()
    timing = next((ln for ln in lines if ln.startswith("[prefill")), "")
    path = next((ln for ln in lines if ln.startswith("[decode path: ")), "[decode path: ?;")
    return wall, timing, path[len("[decode path: "):].split(" (")[0].split(";")[0]


def _compiling_s(timing: str) -> float:
    return float(timing.split("; ")[-1].split(" s ")[0]) if "compiling kernels" in timing else 0.0


def cli_figures(repo: Path, python: str, cache: Path) -> dict:
    wall, timing, path = cli_run(repo, python, cache)
    row = {"first CLI int4 / q8_0 s": round(wall, 1), "of which compiling s": _compiling_s(timing),
           "its decode path": path}
    t0 = time.monotonic()
    wait_done(str(cache / "numba"))  # the background decode-step build of that cache, if one started
    waited = time.monotonic() - t0
    wall, timing, path = cli_run(repo, python, cache)
    return row | {"background build left s": round(waited, 1), "second CLI s": round(wall, 1),
                  "second compiling s": _compiling_s(timing), "second decode path": path}


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench coldstart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=str(REPO), help="the checkout to start (default %(default)s)")
    ap.add_argument("--python", default=sys.executable, help="its interpreter (default %(default)s)")
    ap.add_argument("--limit", type=float, default=1800.0, help="seconds the app may take (default %(default)s)")
    ap.add_argument("--cli-only", action="store_true", help="only the CLI's first and second runs (5 and 6)")
    a = ap.parse_args(argv)
    repo = Path(a.repo).resolve()
    root = Path(tempfile.mkdtemp(prefix="moqe-coldstart-"))
    try:
        row = {"checkout": repo.name}
        if not a.cli_only:
            row |= app_figures(repo, a.python, root / "app", root / "app.log", a.limit)
            _, line, _ = cli_run(repo, a.python, root / "app")
            row["CLI after the app"] = (f"compiled {_compiling_s(line)} s" if _compiling_s(line) else
                                        "compiled nothing")
        row |= cli_figures(repo, a.python, root / "cli")
        print_table([row], f"cold start, {os.cpu_count()} cores")
    finally:
        shutil.rmtree(root, ignore_errors=True)
