"""One assert helper for every kernel test: shape, then dtype, then values (exact or within a tolerance)."""
from __future__ import annotations

import numpy as np


def assert_close(actual, expected, *, atol: float = 0.0, rtol: float = 0.0, exact: bool = False, what: str = ""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    tag = f"{what}: " if what else ""
    assert actual.shape == expected.shape, f"{tag}shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{tag}dtype {actual.dtype} != {expected.dtype}"
    if exact:
        a = actual.view(np.uint8) if actual.dtype.kind == "f" or actual.dtype.name == "bfloat16" else actual
        e = expected.view(np.uint8) if expected.dtype.kind == "f" or expected.dtype.name == "bfloat16" else expected
        if not np.array_equal(a, e):
            bad = np.argwhere(actual != expected) if actual.ndim else np.array([[0]])
            first = tuple(bad[0]) if len(bad) else ()
            raise AssertionError(f"{tag}not bit-identical; first difference at {first}: "
                                 f"{actual[first] if first else actual} vs {expected[first] if first else expected}")
        return
    a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
    err = np.abs(a64 - e64)
    lim = atol + rtol * np.abs(e64)
    if not np.all(err <= lim):
        i = np.unravel_index(np.argmax(err - lim), err.shape)
        raise AssertionError(f"{tag}max violation at {i}: |{a64[i]} - {e64[i]}| = {err[i]:.3g} > {lim[i]:.3g} "
                             f"(atol={atol}, rtol={rtol}); max abs err {err.max():.3g}")


def assert_close_but_requantized(actual, expected, *, tol: float, stray: float, stray_frac: float, what: str = ""):
    """For a pipeline that rounds an intermediate to a coarse grid (fp8 W8A8: GEMM1's output re-quantized to e4m3
    before GEMM2) and two paths whose sums differ in their last bits: a few intermediates land one grid step apart,
    so a few outputs move by a step's worth. All within ``stray`` of max|expected|, and at most ``stray_frac`` of
    them past ``tol`` of it (a wrong layout is off by O(max) nearly everywhere)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    tag = f"{what}: " if what else ""
    assert actual.shape == expected.shape, f"{tag}shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{tag}dtype {actual.dtype} != {expected.dtype}"
    err = np.abs(actual.astype(np.float64) - expected) / max(float(np.abs(expected).max()), 1e-30)
    assert err.max() <= stray, f"{tag}max error {err.max():.3g} of max|expected| > {stray}"
    past = float((err > tol).mean())
    assert past <= stray_frac, f"{tag}{past:.3g} of the outputs are past {tol:.3g} of max|expected| (> {stray_frac})"


def dot_tol(K: int) -> dict:
    """An f32 dot product of K unit-scale terms summed in another order (GEMV lanes, BLAS blocks, a warp's
    reduction): |err| grows with K * eps * |terms|; 4x that for the worst of a few thousand outputs."""
    return dict(atol=4.0 * K * 2.0**-23, rtol=2e-5)


def run_on(dev, run_op, *args, **kwargs):
    """``run_op(dev, *args, **kwargs)``, a launcher (``run_<op>`` of toolkit/gpu/<op>.py) on the device ``dev``,
    with its device results read back to NumPy afterwards (host arrays it was given, None and scalars as they are).
    The launcher itself reads nothing back, as a decode step never waits on the host: the device's counters prove
    it (no synchronisation, no byte copied out)."""
    before = dev.counters.snapshot()
    out = run_op(dev, *args, **kwargs)
    moved = dev.counters.since(before)
    assert moved.syncs == 0 and moved.bytes_out == 0, f"{run_op.__name__} read device memory on the host: {moved}"
    return to_host(dev, out)


def to_host(dev, out):
    """``out`` (an array of ``dev``, or a tuple of them) as NumPy; NumPy arrays, None and scalars unchanged."""
    if isinstance(out, tuple):
        return tuple(to_host(dev, o) for o in out)
    return out if out is None or isinstance(out, (np.ndarray, np.generic, int, float)) else dev.to_host(out)
