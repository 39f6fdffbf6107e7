"""Shared test fixtures. Numba kernels run single-process; keep hypothesis deadlines off (JIT warm-up)."""
import os

from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=60, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
