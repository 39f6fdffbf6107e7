"""Ctrl-C at any moment of a ``moqe`` command is one line and exit status 130 (issue 29), never a traceback.

Each command is started as the console script a user runs (``.venv/bin/moqe``) and sent SIGINT after a delay
from a grid: from just after the interpreter's own start-up (measured here: three times ``python -c pass``,
the part no Python program can guard, since it runs before any of the program's code) to a few seconds in,
through the imports of NumPy and Numba, model loading, kernel compilation and generation. The outcome must be
rc 130 with ``moqe...: interrupted`` as the only stderr line, or rc 0 when the command finished first.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MOQE = Path(sys.executable).with_name("moqe")
COMMANDS = [  # (id, arguments): a quick one, one that compiles and generates, one that quantizes
    ("info", ["info"]),
    ("generate", ["generate", "--prompt", "It is", "--max-new-tokens", "8", "--experts", "int4"]),
    ("quantize", ["quantize", "--experts", "q8_0"]),
    ("quantize-cold", ["quantize", "--experts", "q8_0"]),  # an empty kernel cache: the signal lands while Numba
]  # compiles, at times inside llvmlite's callbacks from C (which swallow a KeyboardInterrupt)
DELAYS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.5)  # seconds after the start-up floor (a margin for a busy machine)


def _startup_floor() -> float:
    t = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        t.append(time.perf_counter() - t0)
    return 3 * sorted(t)[1]


@pytest.fixture(scope="module")
def floor() -> float:
    if not MOQE.exists():
        pytest.skip(f"no console script at {MOQE} (the package is not installed into this environment)")
    return _startup_floor()


@pytest.mark.parametrize("delay", DELAYS)
@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_ctrl_c_is_one_line_and_130(cmd, delay, floor, tmp_path):
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if cmd[0].endswith("-cold"):
        env["NUMBA_CACHE_DIR"] = str(tmp_path.parent / f"{tmp_path.name}-numba")
    p = subprocess.Popen([str(MOQE), *cmd[1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(floor + delay)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"moqe {cmd[0]} did not stop within 120 s of SIGINT")
    lines = [s for s in err.splitlines() if s.strip() and not s.startswith("[compiling kernels")]
    shown = f"rc {p.returncode}, stderr:\n{err[-2000:]}"
    assert "Traceback" not in err, shown
    if p.returncode == 0:  # finished before the signal arrived
        return
    assert p.returncode == 130, shown
    assert lines and lines[-1].startswith("moqe") and lines[-1].endswith("interrupted"), shown
    assert len([s for s in lines if "interrupted" in s or "error" in s]) == 1, shown
    assert not list(tmp_path.iterdir()), f"left files behind: {list(tmp_path.iterdir())}"
