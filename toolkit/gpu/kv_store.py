"""cuda kv_store: launcher of ``cuda_src/kv_store.cu`` (quantize-on-write into the KV cache store).

``store [B, Hkv, S, row]`` (f32 rows of hd, or uint8 rows of hd/32 q8_0 / q4_0 blocks), ``fmt`` the cache
format, ``x f32 [B, T, Hkv, hd]``, ``positions int32 [B, T]``: row ``x[b, t, h]`` is encoded into
``store[b, h, positions[b, t]]`` in place (toolkit/ref/kv_store.py; bytes identical). The format picks a row
struct from ``ROWS`` (a lookup, like ggml's type traits). One warp per 32-value block.
The launcher checks shapes and dtypes only and never reads ``positions`` (no host synchronisation): the runtime
validates positions on the host before it copies them (:func:`check_positions`, also used by the get_op entry);
the kernel skips a row whose position lies outside ``[0, S)`` (no write).
"""
from __future__ import annotations

import numpy as np

from ..formats import FORMATS
from .contract import check_array, contract

SOURCE = "kv_store"
ROWS = {f.name: f.kv_row for f in FORMATS.values() if f.kv_row}  # cache format -> row struct in formats.cuh
KERNELS = tuple(f"kv_store_kernel<{r}>" for r in ROWS.values())
WARPS = 4  # KV_STORE_WARPS in the .cu


def row_spec(fmt, hd: int):
    """(dtype, last dim) of one cache row of ``hd`` values in ``fmt``."""
    (spec,) = fmt.arrays((1, hd)).values()
    return spec.dtype, spec.shape[-1]


def check_kv_store(store, fmt, x, positions) -> None:
    op = "kv_store"
    contract(op, fmt.name in ROWS, f"cache format {fmt.spec!r} has no CUDA row codec; have {', '.join(ROWS)}")
    check_array(op, "x", x, np.float32, ndim=4)
    B, T, Hkv, hd = x.shape
    contract(op, hd % 32 == 0 and hd > 0, f"head dim {hd} must be a positive multiple of 32")
    check_array(op, "positions", positions, np.int32, shape=(B, T))
    dtype, row = row_spec(fmt, hd)
    check_array(op, "store", store, dtype, ndim=4)
    contract(op, tuple(store.shape[:2]) == (B, Hkv) and store.shape[3] == row,
             f"store.shape is {tuple(store.shape)}, expected ({B}, {Hkv}, S, {row}) for {fmt.name} rows of hd={hd}")


def check_positions(op: str, positions: np.ndarray, S: int) -> None:
    """Host-side check of NumPy positions (before they are copied to the device): every one in ``[0, S)``."""
    if positions.size:
        contract(op, int(positions.min()) >= 0 and int(positions.max()) < S, f"positions must lie in [0, S={S})")


def run_kv_store(rt, store, fmt, x, positions) -> None:
    check_kv_store(store, fmt, x, positions)
    B, T, Hkv, hd = x.shape
    S = store.shape[2]
    if not x.size:
        return
    n_blocks = B * T * Hkv * (hd // 32)
    rt.launch(SOURCE, f"kv_store_kernel<{ROWS[fmt.name]}>", (-(-n_blocks // WARPS),), (32 * WARPS,),
              (x, positions, store, np.int32(B), np.int32(T), np.int32(Hkv), np.int32(S), np.int32(hd)))

