"""Numba kernels, one module per op with the same stem as its NumPy reference in ``toolkit/ref``.

Each is tested against the reference (tests/test_ops*.py). Matrix products with dense f32 weights go to
NumPy's BLAS, which is the fast path on a CPU; the quantized expert GEMMs are Numba kernels.
"""
