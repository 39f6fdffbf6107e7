"""Shared test fixtures. Numba kernels run single-process; keep hypothesis deadlines off (JIT warm-up)."""
import os

from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=60, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402


@pytest.fixture(params=["serial", "parallel"])
def kernel_build(request, monkeypatch):
    """Run a test with the serial and with the parallel build of every Numba kernel (toolkit/cpu/_jit.py)."""
    import toolkit.cpu._jit as jit

    monkeypatch.setattr(jit, "PARALLEL_MIN_WORK", 1 << 62 if request.param == "serial" else 0)
    return request.param
