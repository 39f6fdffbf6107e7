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
