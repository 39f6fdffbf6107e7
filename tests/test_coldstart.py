"""A cold run's background compiles (toolkit/cpu/_detached.py, toolkit/model/coldstart.py) and the CLI's
``--compiled-decode auto``: the run decodes on the staged ops, with the same tokens, and the build it found
missing is compiled by a detached process into the disk cache."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from numba import types

from toolkit.cpu import _detached, _jit
from toolkit.load import load_model
from toolkit.model import SamplingParams, generate_tokens
from toolkit.quant import parse_policy

MODEL = Path(__file__).resolve().parents[1] / "data" / "model"
PROMPT_IDS = [1, 820, 343, 261, 1520, 8012, 758, 5527]
REPO = Path(__file__).resolve().parents[1]
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the detached build forks (Linux only)")


@pytest.fixture(scope="module")
def int4():
    return load_model(MODEL, policy=parse_policy("moqe", "int4"), kv_cache="q8_0")[0]


def _tokens(model, n=6):
    return [e.token for e in generate_tokens(model, [PROMPT_IDS], SamplingParams(max_new_tokens=n))]


def _cold(monkeypatch):
    """As on an empty kernel cache: no decode-step build is found compiled or cached."""
    monkeypatch.setattr(_jit, "ready", lambda d, args, compile: bool(compile))
    monkeypatch.setattr(_jit, "ready_sig", lambda d, sig, compile: bool(compile))


def test_auto_decodes_staged_with_the_same_tokens_and_keeps_what_was_missing(int4, monkeypatch):
    int4.compiled_decode, int4._steps = "on", None
    want = _tokens(int4)
    assert int4.decode_paths["compiled"] > 0
    _cold(monkeypatch)
    int4.compiled_decode, int4._steps = "auto", None
    int4.decode_paths = {"compiled": 0, "staged": 0}
    assert _tokens(int4) == want
    assert int4.decode_paths["compiled"] == 0 and int4.decode_paths["staged"] > 0
    builds = int4.missing_builds()
    assert len(builds) == 1  # every layer shares one build (one format, one cache type)
    build, sig = builds[0]
    assert "q8_0_q8_0" in build.py_func.__name__ and len(sig) == build.py_func.__code__.co_argcount


def test_the_helper_job_leaves_the_run_as_it_was(int4, monkeypatch):
    """The helper's job (run here, not forked): the FFNs and the head on throwaway rows, then the decode step's
    build compiled (asked for, never run); the run's model and its tokens are untouched."""
    from numba.core.registry import CPUDispatcher

    from toolkit.model import coldstart

    int4.compiled_decode, int4._steps = "auto", None
    want = _tokens(int4)
    _cold(monkeypatch)
    monkeypatch.setattr(_detached, "start_detached", lambda job, lock_dir=None: (job(), ("started", 1))[1])
    compiled, real = [], CPUDispatcher.compile

    def compile(self, sig):
        if "_decode_layer" not in self.py_func.__name__:
            return real(self, sig)
        compiled.append(self.py_func.__name__)

    monkeypatch.setattr(CPUDispatcher, "compile", compile)
    assert coldstart.help_compile(int4, len(PROMPT_IDS)) == ("started", 1)
    assert compiled and all("q8_0_q8_0" in n for n in compiled)
    assert int4.compiled_decode == "auto" and _tokens(int4) == want


@linux
def test_a_detached_build_compiles_into_the_disk_cache(tmp_path, monkeypatch):
    # a comment unique to this run: Numba keys its disk cache by path and source hash, and pytest's temporary
    # paths repeat across runs (a kernel cached by an earlier run at this path would already be "ready")
    (tmp_path / "kmod.py").write_text(f"# {uuid.uuid4()}" + textwrap.dedent('''
        from numba import njit

        @njit(cache=True)
        def twice_plus_one(x):
            return 2 * x + 1
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import kmod

    sig = (types.int64,)
    assert not _jit.ready_sig(kmod.twice_plus_one, sig, compile=False)  # nowhere yet
    how, pid = _detached.compile_detached([(kmod.twice_plus_one, sig)], lock_dir=str(tmp_path))
    assert how == "started" and pid not in (None, os.getpid())
    assert _detached.wait_done(str(tmp_path), limit_s=120)
    assert _jit.ready_sig(kmod.twice_plus_one, sig, compile=False)  # loaded from the disk: the other process
    assert kmod.twice_plus_one(20) == 41


@linux
def test_a_held_lock_starts_nothing(tmp_path):
    fd = os.open(tmp_path / _detached.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert _detached.start_detached(lambda: None, lock_dir=str(tmp_path)) == ("busy", None)
        assert not _detached.wait_done(str(tmp_path), limit_s=0.5)
    finally:
        os.close(fd)
    assert _detached.wait_done(str(tmp_path), limit_s=5)


@linux
def test_the_detached_process_keeps_none_of_its_callers_pipes(tmp_path):
    """A caller reading the run's output (``subprocess.run(capture_output=True)``) gets EOF when the run exits,
    while the detached process still works: it holds none of the run's descriptors."""
    script = (f"import time; from toolkit.cpu._detached import start_detached; "
              f"print(start_detached(lambda: time.sleep(60), lock_dir={str(tmp_path)!r})[1])")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=40, cwd=REPO)
    pid = int(r.stdout.split()[-1])
    try:
        os.kill(pid, 0)  # still running, its 60 s sleep ahead of it
        assert not _detached.wait_done(str(tmp_path), limit_s=0.5)  # and holding the lock
    finally:
        os.kill(pid, 9)
    assert _detached.wait_done(str(tmp_path), limit_s=10)


def test_the_cli_says_the_decode_step_is_built_in_the_background(monkeypatch, capsys):
    from toolkit.cli import main

    _cold(monkeypatch)
    handed = []
    monkeypatch.setattr(_detached, "compile_detached", lambda builds: (handed.extend(builds), ("started", 4242))[1])
    assert main(["generate", "--experts", "int4", "--kv-cache", "q8_0", "--prompt", "It is a truth",
                 "--max-new-tokens", "4", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "the staged ops" in err and "in the background for later runs (pid 4242" in err
    assert len(handed) == 1 and "_decode_layer" in handed[0][0].py_func.__name__
