"""``python -m toolkit.bench coldstart``: the first five minutes on this machine, with an empty kernel cache.

In order, each in its own process and its own empty kernel cache (a temporary ``NUMBA_CACHE_DIR`` and
``MOQE_EMU_CACHE``, removed at the end), from the checkout given by ``--repo`` (default: this one):
1. ``python -m app``: seconds until its page is served;
2. the page's default comparison (its first two rows, the default prompt, 48 new tokens) through
   ``gradio_client``, sent as soon as the page is served: seconds until it has answered;
3. the app's kernel warm-up: its total seconds and kernels compiled (``/kernel_status``);
4. ``moqe generate --experts int4 --kv-cache q8_0`` (32 new tokens) with the app's cache: kernels it compiled
   (its own timing line says; none is the goal);
5. the same command in a new empty cache: wall seconds of the whole process, compilation included.
Each figure is one run; compare a before and an after measured in one session, one after the other.
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

from .timing import print_table

REPO = Path(__file__).resolve().parents[2]
PROMPT = "It is a truth universally acknowledged"
CLI = ["-m", "toolkit", "generate", "--experts", "int4", "--kv-cache", "q8_0", "--prompt", PROMPT, "--max-new-tokens", "32"]


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


def cli_run(repo: Path, python: str, cache: Path) -> tuple[float, str]:
    t0 = time.monotonic()
    r = subprocess.run([python, *CLI], cwd=repo, env=_env(cache), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"moqe generate failed: {r.stderr[-2000:]}")
    return time.monotonic() - t0, r.stderr.strip().splitlines()[-1]


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench coldstart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=str(REPO), help="the checkout to start (default %(default)s)")
    ap.add_argument("--python", default=sys.executable, help="its interpreter (default %(default)s)")
    ap.add_argument("--limit", type=float, default=1800.0, help="seconds the app may take (default %(default)s)")
    a = ap.parse_args(argv)
    repo = Path(a.repo).resolve()
    root = Path(tempfile.mkdtemp(prefix="moqe-coldstart-"))
    try:
        row = {"checkout": repo.name}
        row |= app_figures(repo, a.python, root / "app", root / "app.log", a.limit)
        _, line = cli_run(repo, a.python, root / "app")
        row["CLI after the app"] = "compiled nothing" if "compiling" not in line else line.split("; ")[-1].rstrip("]")
        wall, line = cli_run(repo, a.python, root / "cli")
        row["first CLI int4 / q8_0 s"] = round(wall, 1)
        row["of which compiling s"] = float(line.split("; ")[-1].split(" s ")[0]) if "compiling" in line else 0.0
        print_table([row], f"cold start, {os.cpu_count()} cores")
    finally:
        shutil.rmtree(root, ignore_errors=True)
