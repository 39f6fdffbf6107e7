"""The decode GEMV's emitted instructions (``toolkit/cpu/gemv.py``): for each format, the innermost loop
holding the most vector FMAs is the fused decode-and-dot the kernel is written to be: full-width vector
FMAs (zmm on AVX-512 hosts, ymm otherwise; 4 weight rows in flight), vector code loads, no gathers, no
byte-by-byte inserts, no scalar int-to-float conversions. Built uncached for the host's widest lanes and,
on AVX-512 hosts, for 8 lanes too (the AVX2 shape of the kernel)."""
from __future__ import annotations

import re

import pytest

from toolkit.cpu.gemv import assembly
from toolkit.cpu.vec import max_lanes

FORBIDDEN = ("vpgatherdd", "vpgatherqd", "vgatherdps", "vgatherqps", "vpinsrb", "vcvtsi2ss", "vcvtsi2ssl")
HOST = max_lanes()
# (format, lanes): every format at the host's width; int4 and q4_0 also at 8 lanes (AVX2's shape) on AVX-512
CASES = [(f, HOST) for f in ("int8", "fp8", "int4-g128", "int3-g64", "int2-g32", "q4_0", "q8_0", "mxfp4", "f16")] + \
        ([("int4-g128", 8), ("q4_0", 8)] if HOST != 8 else [])
KNOWN = {("int3-g64", 16): "int3's 3-byte units are assembled with byte inserts at 16 lanes (int3 is slower "
                           "than int4 there: issue 13)"}


def fma_loop(asm: str) -> list[str]:
    """Instructions of the innermost loop (label .. backward jump to it, holding no other loop) with the
    most vector FMAs."""
    lines = [ln.strip() for ln in asm.splitlines()]
    labels, loops = {}, []
    for i, ln in enumerate(lines):
        if ln.endswith(":") and not ln.startswith("#"):
            labels[ln[:-1]] = i
        elif ln.startswith("j") and len(ln.split()) == 2 and labels.get(ln.split()[1], i) < i:
            loops.append((labels[ln.split()[1]], i))
    best, best_n = [], 0
    for a, b in loops:
        if any(a <= a2 and b2 < b for a2, b2 in loops if (a2, b2) != (a, b)):
            continue  # holds an inner loop
        body = [x for x in lines[a + 1:b + 1] if x and not x.startswith((".", "#"))]
        n = sum(1 for x in body if re.match(r"vfmadd\d+ps\s", x))
        if n > best_n:
            best, best_n = body, n
    return best


@pytest.mark.parametrize("spec, L", [pytest.param(f, L, marks=pytest.mark.xfail(reason=KNOWN[f, L], strict=True))
                                     if (f, L) in KNOWN else (f, L) for f, L in CASES])
def test_gemv_inner_loop(spec, L):
    loop = fma_loop(assembly(spec, L))
    # at the host's width the FMAs must be full width; the 8-lane build on an AVX-512 host may be widened to zmm
    # by LLVM (two 8-lane groups at once: seen for int4-g128), which is still the vector loop, not a scalar one
    regs = ("%zmm",) if L == 16 else ("%ymm", "%zmm") if HOST == 16 else ("%ymm",)
    fmas = [x for x in loop if re.match(r"vfmadd\d+ps\s", x)]
    assert len(fmas) >= 4, f"{spec} L={L}: no 4-row vector FMA loop found ({len(fmas)} FMAs):\n" + "\n".join(loop)
    assert all(any(r in x for r in regs) for x in fmas), f"{spec} L={L}: FMAs not on {'/'.join(regs)}:\n" + "\n".join(fmas)
    bad = [x for x in loop if x.split()[0] in FORBIDDEN]
    assert not bad, f"{spec} L={L}: the inner loop gathers or converts scalars:\n" + "\n".join(bad)
