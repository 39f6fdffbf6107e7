"""cuda moe_gemm of fp8 (e4m3 W8A8) experts at prefill on Hopper's wgmma: the constants of
``cuda_src/moe_gemm_wgmma.cu``, and which launches it takes.

``run_moe_gemm_mma`` hands it its 128-token blocks of e4m3 experts (:func:`runs`): the same arguments, layout and
result as ``moe_gemm_mma``, with 128 weight rows x 128 tokens a block of two warpgroups, four wgmma m64n128k32 a
k-tile from 4 cp.async stages (132 KB of dynamic shared memory, one block an SM). mma.sync's e4m3 runs at half of
Hopper's fp8 rate (ptxas makes it two f16 HMMA); wgmma at the whole of it, and its 64 x 128 warpgroup tiles take
0.0195 shared bytes a FLOP: a design ceiling of 0.8 of the dense peak (``toolkit.gpu.occupancy.prefill_table``).
wgmma exists on sm_90a only (H100 / H200; not sm_80, not Blackwell's sm_100): the stem compiles with
``-arch=sm_90a`` (``ARCH_SPECIFIC``), which CuPy's RawModule cannot pass, so the GPU device loads its cubin from
``toolkit.gpu.nvrtc.build``.

Hopper's fp8 wgmma sums with 13 bits of mantissa, not f32's (cuda_src/wgmma.cuh; first seen on an H100 on
2026-12-06, where the first form of this kernel, letting the wgmmas add up all of K, failed its GPU tests: 0.29 off
the Numba kernel at K 4096, 0.90 at K 14336). So each k-tile's four wgmmas start a fresh sum, added into f32
registers once they are done. On a GPU the kernel first checks itself against NumPy over K 4096
(:func:`verified`), where the 13-bit sums show, and stands aside if it disagrees.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np

SOURCE = "moe_gemm_wgmma"
KERNEL = "moe_gemm_wgmma_e4m3"
KERNELS = (KERNEL,)
ARCH_SPECIFIC = (90,)  # compiled for sm_90a (source.arch_name)
ARCH = 900  # the one compute capability with wgmma
THREADS, TN, BM, KB, STAGES = 256, 128, 128, 128, 4  # WG_THREADS, WG_TN, WG_BM, WG_KB, WG_STAGES
SMEM = STAGES * 2 * TN * KB + 1024  # WG_SMEM: 4 stages of weights and tokens, 1 KB to align the swizzle atoms
MIN_BLOCKS = 1  # __launch_bounds__(256, 1)


def available(rt) -> bool:
    """Whether the device runs wgmma: sm_90, or the emulated device at its default (every emulated instruction)."""
    arch = getattr(rt, "arch", None)
    return arch is None or arch == ARCH


def why_not(rt, w, block_m: int, mode: int, run) -> str | None:
    """Why ``w`` at ``block_m`` cannot run on this kernel (None: it can): e4m3 weights as stored, 128-token
    blocks, rows as stored (mode 0) or GEMM1 with silu_and_mul (mode 2; not 1: codes packed with halves are never
    e4m3), K a multiple of 16 (16-byte copies), a device with wgmma, which on a real GPU passed :func:`verified`
    (``run``: ``moe_gemm_mma.run_moe_gemm_mma``, the launcher that hands the blocks over)."""
    if w.fmt.act_quant is None:
        return f"format {w.fmt.name!r} is not e4m3 W8A8"
    if block_m != BM:
        return f"block_m {block_m} (wgmma tiles are {BM} tokens)"
    if mode not in (0, 2):
        return f"mode {mode}: gate_up packed with halves (e4m3 codes are not packed)"
    if w.shape[2] % 16:
        return f"K = {w.shape[2]} is not a multiple of 16"
    if not available(rt):
        return f"this device is sm_{getattr(rt, 'arch', 0) // 10}; wgmma needs sm_90"
    if getattr(rt, "name", None) == "cuda" and not verified(rt, run):
        return "its self-check on this GPU disagreed with NumPy (see the warning)"
    return None


SELF_CHECK_TOL = 1e-3  # of max|out| at K 4096: by the 13-bit model 1.3e-4 as built, 2.7e-3 with sums over all of K
_VERIFIED: dict = {}


def verified(rt, run) -> bool:
    """Whether the kernel gives NumPy's products on this device: :func:`self_check`, once per device. On a real GPU a
    disagreement sends fp8's 128-token blocks back to mma.sync at 64, with a warning, instead of wrong logits."""
    key = id(rt)
    if key not in _VERIFIED:
        _VERIFIED[key] = True  # the check runs the kernel itself
        ok, err = self_check(rt, run)
        _VERIFIED[key] = ok
        if not ok:
            warnings.warn(f"moe_gemm_wgmma: its self-check on this GPU is {err:.3g} of max|out| off NumPy (more than "
                          f"{SELF_CHECK_TOL}); fp8 prefill falls back to mma.sync at block_m 64. Please report it.")
    return _VERIFIED[key]


def self_check(rt, run) -> tuple[bool, float]:
    """One 128-token block of a [1, 128, 4096] fp8 expert through ``run`` (``run_moe_gemm_mma``) on ``rt`` against
    the NumPy reference -> (within ``SELF_CHECK_TOL`` of max|out|, the error as that fraction). K 4096: 32 k-tiles,
    where sums of 13 bits left to run over all of K show. Reads one small result back."""
    from ..formats import get_format
    from ..ref.moe_align import moe_align
    from ..ref.moe_gemm import moe_gemm

    rng = np.random.default_rng(90)
    E, N, K, T = 1, TN, 32 * KB, BM
    w = get_format("fp8").quantize(rng.standard_normal((E, N, K)).astype(np.float32))
    x = rng.standard_normal((T, K)).astype(np.float32)
    sorted_ids, expert_ids, _ = moe_align(np.zeros((T, 1), np.int32), E, BM)
    want = moe_gemm(x, w, sorted_ids, expert_ids, BM, 1)
    wd = dataclasses.replace(w, arrays={k: rt.to_device(np.ascontiguousarray(a)) for k, a in w.arrays.items()})
    got = rt.to_host(run(rt, rt.to_device(x), wd, rt.to_device(sorted_ids), rt.to_device(expert_ids), BM, 1, split=1))
    err = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))
    return bool(err <= SELF_CHECK_TOL), err


def runs(rt, w, run) -> bool:
    """Whether ``w``'s 128-token blocks run here (``moe_gemm_mma.has_wide``)."""
    return why_not(rt, w, BM, 0, run) is None
