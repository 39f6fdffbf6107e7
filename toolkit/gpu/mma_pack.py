"""Affine int2/3/4 expert codes repacked once, at upload, for the tensor-core GEMM (cuda_src/moe_gemm_mma.cu).

The stored layout (``qweight [E, N, K * bits / 8]``, 8 codes LSB first in ``bits`` bytes) makes a thread of the
kernel read 8 codes at a time. Repacked, each expert is cut into tiles of 64 rows x 64 k, and each tile into the
128 threads' shares in the order the kernel decodes them: thread t holds the 8-code chunks t, t + 128, t + 256,
t + 384 of the tile (chunk c: tile row c // 8, k (c % 8) * 8 ..), so its 32 codes for a k-tile are one 16-byte
load (int4), one 8-byte load (int2) or three aligned words (int3's whole 32-code unit), and a warp reads 512
contiguous bytes (int4). Same bytes, same total size: ``mma_codes [E, N / 64, K / 64, 128 * 4 * bits / 8]``.

``halves`` (gate_up ``[E, 2I, K]``): tile R holds gate rows 32 R .. 32 R + 31 and up rows I + 32 R .., the rows a
block of the kernel needs to apply silu_and_mul in its epilogue. Scales and biases are left as stored. The packed
QTensor keeps the format and shape; its codes array is named ``mma_codes`` / ``mma_codes_halves`` so that nothing
else mistakes it for the stored layout (the other kernels refuse it, and the contract names why).
"""
from __future__ import annotations

import dataclasses

import numpy as np

TILE = 64  # rows and k per tile
THREADS = 128
KEYS = {"natural": "mma_codes", "halves": "mma_codes_halves"}


def packable(qt) -> bool:
    """Affine int2/3/4 (decoder AffineDec), [E, N, K] with N and K multiples of 64, codes in the stored layout."""
    fmt = qt.fmt
    if not (fmt.cuda_decoder or "").startswith("AffineDec<") or fmt.bits not in (2, 3, 4) or len(qt.shape) != 3:
        return False
    _, N, K = qt.shape
    return N % TILE == 0 and K % TILE == 0 and "qweight" in qt.arrays


def packing(qt) -> str | None:
    """'natural', 'halves', or None when the codes are in the stored layout."""
    return next((kind for kind, key in KEYS.items() if key in qt.arrays), None)


def _tile_rows(N: int, halves: bool) -> np.ndarray:
    """[N / 64, 64]: the rows of each tile."""
    r = np.arange(TILE)
    if not halves:
        return np.arange(N // TILE)[:, None] * TILE + r
    g = np.arange(N // TILE)[:, None] * (TILE // 2)
    return np.where(r < TILE // 2, g + r, N // 2 + g + r - TILE // 2)


def _chunks():
    c = np.arange(THREADS)[:, None] + THREADS * np.arange(4)  # [128 threads, 4 chunks]
    return c // 8, c % 8  # tile row, chunk within the row's 64 k


def _xp(a):
    """NumPy, or CuPy for a CuPy array (the bench packs weights it generated on the GPU)."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def pack(qt, halves: bool = False):
    """The QTensor with its codes in the kernel's tile order (NumPy or CuPy arrays). ValueError if not packable."""
    if not packable(qt):
        raise ValueError(f"mma_pack: {qt.fmt.spec} {tuple(qt.shape)} is not affine int2/3/4 with N, K multiples of 64")
    E, N, K = qt.shape
    b = qt.fmt.bits
    xp = _xp(qt.arrays["qweight"])
    codes = xp.asarray(qt.arrays["qweight"]).reshape(E, N, K // 8, b)  # [E, N, K/8 chunks, bits bytes]
    rows, k8 = _chunks()
    tr = np.broadcast_to(_tile_rows(N, halves)[:, rows][:, None], (N // TILE, K // TILE, THREADS, 4))  # row of chunk
    kc = np.broadcast_to((np.arange(K // TILE)[:, None, None] * 8 + k8)[None], tr.shape)  # its 8-code column
    packed = codes[:, xp.asarray(tr), xp.asarray(kc), :]  # [E, N/64, K/64, 128, 4, bits]
    arrays = {KEYS["halves" if halves else "natural"]: xp.ascontiguousarray(packed.reshape(E, N // TILE, K // TILE, -1))}
    arrays.update({k: v for k, v in qt.arrays.items() if k != "qweight"})
    return dataclasses.replace(qt, arrays=arrays)


def unpack(qt):
    """The stored layout back (tests: the packing is a permutation of the code bytes)."""
    kind = packing(qt)
    E, N, K = qt.shape
    b = qt.fmt.bits
    packed = np.asarray(qt.arrays[KEYS[kind]]).reshape(E, N // TILE, K // TILE, THREADS, 4, b)
    rows, k8 = _chunks()
    tr = np.broadcast_to(_tile_rows(N, kind == "halves")[:, rows][:, None], (N // TILE, K // TILE, THREADS, 4))
    kc = np.broadcast_to((np.arange(K // TILE)[:, None, None] * 8 + k8)[None], tr.shape)
    codes = np.empty((E, N, K // 8, b), np.uint8)
    codes[:, tr, kc, :] = packed
    arrays = {"qweight": codes.reshape(E, N, K * b // 8)}
    arrays.update({k: v for k, v in qt.arrays.items() if k != KEYS[kind]})
    return dataclasses.replace(qt, arrays=arrays)


def kernel_arrays(qt) -> list:
    """The arrays in the order the kernels take them: codes (stored or packed), then scales, biases."""
    kind = packing(qt)
    names = list(qt.fmt.arrays(qt.shape))
    if kind is not None:
        names[names.index("qweight")] = KEYS[kind]
    return [qt.arrays[n] for n in names]


def packed_shape(qt) -> tuple:
    E, N, K = qt.shape
    return (E, N // TILE, K // TILE, THREADS * 4 * qt.fmt.bits)
