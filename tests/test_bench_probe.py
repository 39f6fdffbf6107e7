"""The streaming-read bandwidth probe (``toolkit.bench.timing``): it sums what it reads, its loop is packed
vector adds over the loads (no gathers, no scalar inserts, no per-element index fix-ups), and it reads at
least as fast as torch's f32 GEMV in the same run (every "fraction of bandwidth" the benches print is
against it, so a slow probe would flatter every kernel)."""
from __future__ import annotations

import re

import numba
import numpy as np
import pytest

from toolkit.bench import timing


@pytest.mark.parametrize("n", [1, 7, 8, 1000, 8 * 4096 + 5, 3 * 1024 * 1024 + 17])
@pytest.mark.parametrize("threads", [1, 2])
def test_probe_reads_every_element_once(n, threads):
    a = np.arange(n, dtype=np.float32) % 7  # small integers: every partial sum is exact in f32
    want = float(np.sum(a, dtype=np.float64))
    assert timing.stream_read(a, min(threads, numba.config.NUMBA_NUM_THREADS)) == want


def _probe_asm() -> str:
    """The probe's assembly, compiled afresh (Numba will not inspect code loaded from its disk cache)."""
    opts = {k: v for k, v in timing._sum_chunk.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = numba.njit(**opts)(timing._sum_chunk.py_func)
    fresh(np.ones(64, np.float32), 0, 64)
    return fresh.inspect_asm(fresh.signatures[0])


def test_probe_loop_is_packed_vector_adds_over_the_loads():
    asm = _probe_asm()
    ins = [line.strip() for line in asm.splitlines() if line.startswith("\t") and not line.strip().startswith(".")]
    wide = re.compile(r"%[yz]mm\d+")
    # packed adds (or FMAs) on 256/512-bit registers reading memory directly, or fed by packed loads
    packed_mem_adds = [i for i in ins if re.match(r"v(add|fmadd\w*)ps\s", i) and "(" in i and wide.search(i)]
    packed_loads = [i for i in ins if re.match(r"vmov(u|a)ps\s", i) and wide.search(i) and re.search(r"\(%\w+", i.split(",")[0])]
    packed_adds = [i for i in ins if re.match(r"v(add|fmadd\w*)ps\s", i) and wide.search(i)]
    assert len(packed_mem_adds) >= 8 or (len(packed_loads) >= 8 and len(packed_adds) >= 8), "\n".join(ins)
    # what the old prange loop compiled to: gathers, scalar inserts, per-element conversions
    for bad in ("gather", "vinsertps", "vpinsr", "vcvtsi2ss", "vpbroadcastq"):
        assert not any(bad in i for i in ins), f"{bad} in the probe's loop:\n" + "\n".join(ins)


def test_probe_reads_at_least_as_fast_as_torch_f32_gemv():
    """Same run, 1 thread, alternating passes (both see the same load): the median of the per-pass ratios
    probe GB/s / torch GB/s must be >= 0.9 (a margin for a shared machine)."""
    pytest.importorskip("torch")
    r = timing.probe_vs_torch(rounds=21, mib=512, threads=1)
    print(r)
    assert r["probe/torch"] >= 0.9, r
