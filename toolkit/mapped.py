"""Pages of a memory-mapped, read-only weight file that a packed copy has replaced: handed back to the kernel.

A weight read from a GGUF file or a bundle's shards is a view of a read-only file mapping. Once the CPU
kernels' packed layout of it exists (``toolkit/cpu/decoders.packed``), the mapped pages are no longer read;
``release`` drops them from this process (``madvise(MADV_DONTNEED)``), so resident memory holds the packed
layout once instead of both. Nothing is lost: the pages stay in the file (and the page cache), and a later
read (an export, a dequantize) faults them back in with the same bytes.

Only pages of a **file-backed, non-writable** mapping are ever released: the address range is looked up in
``/proc/self/maps`` first (an anonymous or writable page dropped this way would read back as zeros). Anywhere
that check cannot be made (not Linux) nothing is released.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4
_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _LIBC


def file_ranges() -> list[tuple[int, int]]:
    """[(start, end)] of this process's file-backed mappings that are readable and not writable."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/") or parts[1][0] != "r" or parts[1][1] == "w":
                continue
            lo, hi = parts[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return sorted(out)


def _inside(ranges, lo: int, hi: int) -> bool:
    """Whether [lo, hi) lies in one mapping, or in adjacent ones (a large file may be mapped in pieces)."""
    for a, b in ranges:
        if a <= lo < b:
            if hi <= b:
                return True
            lo = b
    return False


def release(arrays, ranges=None) -> int:
    """Drop this process's resident pages of each C-contiguous array in ``arrays`` that is a view of a read-only
    file mapping (whole pages inside the array only); returns the bytes released. Others are left alone.
    ``ranges``: :func:`file_ranges` read once by a caller releasing many pieces of the same mappings."""
    if not sys.platform.startswith("linux"):
        return 0
    todo = []
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.nbytes < _PAGE or a.flags.writeable or not a.flags.c_contiguous:
            continue
        lo = -(-a.ctypes.data // _PAGE) * _PAGE
        hi = (a.ctypes.data + a.nbytes) // _PAGE * _PAGE
        if hi > lo:
            todo.append((lo, hi))
    if not todo:
        return 0
    ranges, done = ranges if ranges is not None else file_ranges(), 0
    for lo, hi in todo:
        if _inside(ranges, lo, hi) and _libc().madvise(ctypes.c_void_p(lo), hi - lo, _MADV_DONTNEED) == 0:
            done += hi - lo
    return done


def resident(pid: int | str = "self") -> dict[str, int]:
    """A process's resident bytes now and at their peak: {'rss', 'peak', 'anon', 'file'} (0 where unknown, or
    once the process is gone); this one's by default."""
    keys = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    out = dict.fromkeys(keys.values(), 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in keys:
                    out[keys[k]] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak() -> bool:
    """Start this process's peak resident set (``VmHWM``) again from what it holds now (Linux >= 4.0: "5" written to
    ``/proc/self/clear_refs``), so that a later ``resident()["peak"]`` is the peak of what ran since; False where
    that cannot be done (the peak then spans the process's life)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def file_backed(a: np.ndarray, ranges=None) -> bool:
    """Whether ``a``'s bytes lie in a read-only file mapping (pages the kernel can drop and read back)."""
    if not sys.platform.startswith("linux") or not isinstance(a, np.ndarray) or not a.nbytes:
        return False
    return _inside(ranges if ranges is not None else file_ranges(), a.ctypes.data, a.ctypes.data + a.nbytes)
