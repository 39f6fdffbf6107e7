"""``.ci/gpu-check``'s flow without a GPU: the driver (toolkit/bench/gpu_check.py) run on the emulated device with a
small budget, so every landing proves what the one bounded GPU run relies on: every step reached and reported,
at most 7 files back, rows streamed as measured (a step cut by its limit keeps them and says "time limit"), the
budget held, and the one-line stop when no GPU is visible."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
STATUSES = {"ok", "skipped", "failed", "time limit"}


def _gpu_check(out: Path, *args: str, emulate: bool = True, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOQE_GPU_CHECK_EMULATE"}
    cmd = [sys.executable, "-m", "toolkit.bench", "gpu_check", str(out), *(["--emulate"] if emulate else []), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _tsv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_gpu_check_emulated_reaches_every_step_streams_rows_and_holds_its_budget(tmp_path):
    budget, slack = 120, 5  # graphs builds the emulator's kernels when ~/.cache/moqe is cold: ~35 s here
    t0 = time.monotonic()
    # the seed table pauses 2.5 s after each row and is cut at 12 s: the rows measured before the cut must stay
    r = _gpu_check(tmp_path, "--budget", str(budget), "--limit", "graphs=100", "--limit", "moe=12", "--moe-pause", "2.5")
    wall = time.monotonic() - t0
    assert wall < budget + slack, (wall, r.stdout[-3000:])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= 7 and set(files) <= set(gpu_check.FILES), files
    summary = {row["step"]: row for row in _tsv(tmp_path / "summary.tsv")}
    assert list(summary) == list(gpu_check.CAPS), summary
    assert all(row["status"] in STATUSES for row in summary.values()), summary
    assert summary["moe"]["status"] == "time limit", summary["moe"]
    assert r.returncode == 1, (r.returncode, r.stdout[-3000:])  # the one step cut, nothing failed
    for step in ("device", "ceilings", "graphs", "decode", "profile"):
        assert summary[step]["status"] == "ok", (step, summary[step], r.stdout[-3000:])
    assert summary["model"]["status"] == "skipped" and "skipped" in summary["model"]["note"]  # no GPU: not "ok"
    assert all(summary[s]["status"] == "skipped" for s in ("kernels", "mma", "ops"))
    ceilings = _tsv(tmp_path / "ceilings.tsv")
    assert ceilings[0]["ceiling"] == "copy" and float(ceilings[0]["value"]) > 0
    assert all(row["note"].startswith("skipped: emulated") for row in ceilings[1:]) and len(ceilings) == 1 + 2 * 3 * 7
    moe = _tsv(tmp_path / "seed-moe.tsv")
    assert 1 <= len(moe) < 3 * 3 * 2, moe  # some rows kept, not all: written as measured, cut mid-table
    assert all(float(row["us"]) > 0 and float(row["GB/s seed"]) > 0 for row in moe)
    assert moe[0]["seed of copy"] != "-"  # the fraction of this run's copy ceiling
    decode = _tsv(tmp_path / "decode.tsv")  # 1 and 2 layers measured, 32 extrapolated from them
    assert [row["layers"] for row in decode] == ["1", "2", "32 (extrapolated)"], decode
    assert all(float(row["ms/token"]) > 0 for row in decode) and float(decode[2]["per layer ms"]) > 0
    log = (tmp_path / "gpu-check.log").read_text()
    assert "same text with and without CUDA graphs" in log and "| int8 |" in log
    assert "profiled: int2-g64 M=1" in log and "profiled: q2_k M=1" in log  # the profile step's launches, every
    # format (no ncu here), packed int4's prefill among them (block_m 128 on an sm_90 device: its staged codes)
    assert "profiled: int4-g128 M=256" in log


def test_gpu_check_skips_what_its_budget_cannot_hold(tmp_path):
    t0 = time.monotonic()
    budget = gpu_check.GRACE_S + gpu_check.MIN_STEP_S + 0.2  # room for the first step only (it takes > 0.2 s)
    r = _gpu_check(tmp_path, "--budget", str(budget))
    assert time.monotonic() - t0 < budget + 5, r.stdout[-2000:]
    summary = {row["step"]: row for row in _tsv(tmp_path / "summary.tsv")}
    assert list(summary) == list(gpu_check.CAPS)
    assert summary["device"]["status"] == "ok", summary
    assert all(summary[s]["status"] == "skipped" and summary[s]["note"].startswith("budget spent")
               for s in ("ceilings", "model", "graphs", "moe")), summary
    assert r.returncode == 0 and "| moe | skipped |" in r.stdout


def test_a_step_cut_by_its_limit_keeps_its_output_and_says_time_limit(tmp_path):
    log = gpu_check.Log(tmp_path)
    child = ("import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
             "for i in range(3): print('row', i, flush=True)\ntime.sleep(60)")
    t0 = time.monotonic()
    rc, stopped, lines = gpu_check.run_step(sys.executable, ["-c", child], 1.0, log, dict(os.environ))
    assert time.monotonic() - t0 < 1.0 + gpu_check.KILL_S + 2  # SIGINT ignored: SIGKILL after KILL_S
    assert stopped and rc == -9 and [ln.strip() for ln in lines] == ["row 0", "row 1", "row 2"]
    assert gpu_check.verdict("plain", rc, stopped, lines, 1.0)[0] == "time limit"
    assert gpu_check.verdict("plain", 137, False, [], 1.0)[0] == "time limit"
    assert gpu_check.verdict("plain", 124, False, [], 1.0)[0] == "time limit"
    assert "row 2" in (tmp_path / "gpu-check.log").read_text()


def test_gpu_check_without_gpu_stops_with_one_line(tmp_path):
    from toolkit.backend import cuda_unavailable_reason

    if cuda_unavailable_reason() is None:
        pytest.skip("a GPU is present")
    r = _gpu_check(tmp_path, emulate=False, timeout=60)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "no GPU visible" in lines[0], (r.returncode, lines)


# the benches' files under the project's rules: --rows appended through the write rule's target checks
# (writes.check_append_target), --ceilings read through the read rule (files.read_text)
ROWS_TARGETS = [("symlink", r"is a symbolic link"), ("folder", r"is a folder"), ("fifo", r"not a regular file"),
                ("no-parent", r"no such folder")]


def _target(tmp_path, kind: str):
    p = tmp_path / "rows.tsv"
    if kind == "symlink":
        (tmp_path / "real.tsv").write_text("x\n")
        p.symlink_to(tmp_path / "real.tsv")
    elif kind == "folder":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "no-parent":
        p = tmp_path / "missing" / "rows.tsv"
    return p


@pytest.mark.parametrize("kind,message", ROWS_TARGETS, ids=[k for k, _ in ROWS_TARGETS])
def test_bench_rows_target_follows_the_write_rule(tmp_path, kind, message):
    from toolkit.bench.timing import RowStream
    from toolkit.writes import WriteError

    p = _target(tmp_path, kind)
    with pytest.raises(WriteError, match=message):
        RowStream("t", str(p))
    if kind == "symlink":
        assert (tmp_path / "real.tsv").read_text() == "x\n"  # the file behind the link untouched


@pytest.mark.parametrize("kind,message", [("folder", r"is a directory, not a regular ceilings table"),
                                          ("fifo", r"is a FIFO, not a regular ceilings table")])
def test_ceilings_table_is_read_through_the_read_rule(tmp_path, kind, message):
    from toolkit.bench.seed_moe import read_ceilings
    from toolkit.errors import ModelError

    with pytest.raises(ModelError, match=message):
        read_ceilings(str(_target(tmp_path, kind)))
    assert read_ceilings(str(tmp_path / "absent.tsv")) == {}  # no ceilings step: every fraction "-"


# ncu --csv --page raw --print-units base, as it prints a run of two kernels: its ==PROF== lines, a header of
# metric names, a line of units, a line a kernel (the layout of Nsight Compute's raw page; values made up)
NCU_RAW = """==PROF== Connected to process 4242 (python3)
==PROF== Profiling "moe_gemm_mma": 0%....50%....100% - 38 passes
"ID","Kernel Name","dram__bytes_read.sum","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed",\
"sm__warps_active.avg.pct_of_peak_sustained_active","launch__registers_per_thread",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__pcsamp_warps_issue_stalled_barrier",\
"l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed","sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",\
"sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
"","","byte","nsecond","%","%","register/thread","ratio","ratio","ratio","","%","%","%"
"0","moe_gemm_mma<Int8Dec, OpF16, 16>(const float *, ...)","117,440,512","75152","52.1","38.5","88","7.5","0.4","1.2","13",\
"61.5","22.0","0"
"1","moe_gemm_mma<AffinePackedDec<4>, OpF16, 16>(const float *, ...)","58720256","47904","44.0","41.0","80","3.1",\
"2.2","0.9","40","","n/a","3.5"
==PROF== Disconnected from process 4242
"""


def test_ncu_rows_read_the_raw_page():
    """The profile step's parser: a row a kernel, time in us, GB/s read from bytes over time, the collected
    percentages as printed, and the three largest stall reasons of one metric family (not mixed with ncu's PC
    sampling counts, another family)."""
    from toolkit.bench import ncu_profile

    kernels = ncu_profile.parse_raw_csv(NCU_RAW)
    assert len(kernels) == 2 and kernels[1]["launch__registers_per_thread"] == "80"
    row = ncu_profile.summarize(kernels[0], "int8", 1)
    assert row["us"] == pytest.approx(75.152) and row["DRAM GB/s read"] == pytest.approx(117440512 / 75152)
    assert row["DRAM % of peak"] == 52.1 and row["achieved occupancy %"] == 38.5 and row["registers"] == 88
    assert row["theoretical occupancy %"] is None  # not collected: "-" in the table
    assert row["top stalls"] == "long_scoreboard 7.50, wait 1.20, barrier 0.40"
    # the metrics whose names vary (MATCHED): the largest found, "-" where none; mma.sync's HMMA or wgmma's GMMA pipe
    assert (row["smem bank reads %"], row["smem bank writes %"], row["tensor pipe %"]) == (61.5, None, 22.0)
    row4 = ncu_profile.summarize(kernels[1], "int4", 1)
    assert row4["top stalls"].startswith("long_scoreboard 3.10, barrier 2.20")
    assert (row4["smem bank reads %"], row4["tensor pipe %"]) == (None, 3.5)  # empty and "n/a" are not values
    assert ncu_profile.parse_raw_csv("==PROF== no kernels\n") == []


def test_ncu_profile_targets_pass_the_append_rule_before_anything_runs(tmp_path, monkeypatch):
    """--rows and --raw are appended tables (toolkit/writes.py check_append_target), checked before ncu or any
    launch: a folder or a symbolic link is refused by name, and a user's file there is only ever added to (here,
    with no ncu, left byte for byte)."""
    from toolkit.bench import ncu_profile
    from toolkit.writes import WriteError

    folder, mine = tmp_path / "a-folder", tmp_path / "mine.csv"
    folder.mkdir()
    mine.write_text("my own numbers\n")
    (tmp_path / "link.csv").symlink_to(mine)
    monkeypatch.setattr(ncu_profile, "find_ncu", lambda: None)
    for flag, target in (("--raw", folder), ("--raw", tmp_path / "link.csv"), ("--rows", folder)):
        with pytest.raises(WriteError, match="folder|symbolic link"):
            ncu_profile.run([flag, str(target)])
    assert ncu_profile.run(["--raw", str(mine), "--rows", str(tmp_path / "rows.tsv")]) == 0
    assert mine.read_text() == "my own numbers\n" and not (tmp_path / "rows.tsv").exists()
