"""cuda moe_gemm: launcher of ``cuda_src/moe_gemm.cu`` (grouped GEMM over the M-blocks of moe_align).

``x f32 [T or T*A, K]``, ``w`` QTensor ``[E, N, K]``, ``sorted_ids [P]``, ``expert_ids [P / block_m]`` ->
``out f32 [T*A, N]`` (see toolkit/ref/moe_gemm.py). The layout is either the reference's exact one or
run_moe_align's upper-bound one (blocks whose expert is ``-1`` do nothing). The format picks a decoder from
``DECODERS`` (a lookup, like ggml's type traits); W8A8 formats (``fmt.act_quant``) first run fp8_act_quant on the
activations. Kernel (``default_kind``): on a device with tensor cores (sm_80+; fp8 needs sm_89+) the MMA kernel
of ``cuda_src/moe_gemm_mma.cu`` (:mod:`toolkit.gpu.moe_gemm_mma`) for every M; elsewhere (and where the device's
architecture is unknown, as in the default emulation) vLLM's rule: the split-K GEMV kernel when
``slots / E <= 6`` (decode), the tiled kernel otherwise. The plan (kernel, grid, split-K) depends on shapes only:
nothing is read back to the host.
"""
from __future__ import annotations

import numpy as np

from ..formats import FORMATS
from . import moe_gemm_mma as mma
from .fp8_act_quant import run_fp8_act_quant
from .contract import NULL, check_array, contract

SOURCE = "moe_gemm"
DECODERS = {f.name: f.cuda_decoder for f in FORMATS.values() if f.cuda_decoder}  # format -> decoder struct
BLOCK_MS = {"splitk": (16,), "tiled": (16, 64)}  # M-block sizes instantiated per kernel (splitk<64>: 64
# accumulators per lane, a poor GEMV and 5x the compile time; block_m=64 always takes the tiled kernel)
KERNELS = tuple(f"moe_gemm_{kind}<{dec}, {bm}>" for kind, bms in BLOCK_MS.items() for dec in DECODERS.values()
                for bm in bms)
SK_WARPS, TN, TILE_THREADS = 4, 64, 256
DECODE_SLOTS_PER_EXPERT = 6
TARGET_BLOCKS = 264  # ~2 waves of 132 SMs (H100/H200) for the split-K grid


def kernel_name(kind: str, fmt, block_m: int) -> str:
    return f"moe_gemm_{kind}<{DECODERS[fmt.name]}, {block_m}>"


def check_moe_gemm(x, w, sorted_ids, expert_ids, block_m, top_k, topk_weights=None, x_is_slots=False) -> None:
    op = "moe_gemm"
    contract(op, w.fmt.name in DECODERS, f"format {w.fmt.spec!r} has no CUDA decoder; have {', '.join(DECODERS)}")
    contract(op, len(w.shape) == 3, f"weight shape {tuple(w.shape)} must be [E, N, K]")
    E, N, K = w.shape
    contract(op, K % 32 == 0, f"K={K} must be a multiple of 32")
    built = sorted({*BLOCK_MS["tiled"], *mma.BLOCK_MS})  # per kernel: checked where the kernel is chosen
    contract(op, int(block_m) in built, f"block_m={block_m} must be one of {tuple(built)}")
    check_array(op, "x", x, np.float32, ndim=2)
    contract(op, x.shape[1] == K, f"x.shape[1]={x.shape[1]} != K={K} of the weight")
    check_array(op, "sorted_ids", sorted_ids, np.int32, ndim=1)
    check_array(op, "expert_ids", expert_ids, np.int32, ndim=1)
    contract(op, sorted_ids.shape[0] == expert_ids.shape[0] * block_m,
             f"sorted_ids has {sorted_ids.shape[0]} entries, expected len(expert_ids) * block_m = {expert_ids.shape[0] * block_m}")
    if mma.mma_pack.packing(w):  # codes in the tensor-core kernel's tile order
        contract(op, N % 64 == 0 and K % 64 == 0, f"packed codes need N, K multiples of 64, got {N}, {K}")
        specs = mma.mma_pack.array_specs(w)
    else:
        specs = {name: (spec.dtype, spec.shape) for name, spec in w.fmt.arrays(w.shape).items()}
    for name, (dtype, shape) in specs.items():
        contract(op, name in w.arrays, f"w has no array {name!r} (has {sorted(w.arrays)})")
        check_array(op, f"w.{name}", w.arrays[name], dtype, shape=shape)
    if topk_weights is not None:
        check_array(op, "topk_weights", topk_weights, np.float32)
        n_slots = x.shape[0] if x_is_slots else x.shape[0] * top_k
        contract(op, topk_weights.size == n_slots, f"topk_weights has {topk_weights.size} entries for {n_slots} slots")


def default_kind(rt, fmt, decode: bool) -> str:
    """'mma' (tensor cores, cuda_src/moe_gemm_mma.cu) where the device has them (sm_80+; e4m3 needs
    sm_89+) unless MOQE_CUDA_TENSOR_CORES=0, else the split-K GEMV for decode and the tiled kernel otherwise."""
    if mma.tensor_cores(rt) and mma.supports(rt, fmt):
        return "mma"
    return "splitk" if decode else "tiled"


def run_moe_gemm(rt, x, w, sorted_ids, expert_ids, block_m, top_k, topk_weights=None, x_is_slots=False,
                 kind: str | None = None, **mma_options):
    """``w``: a QTensor whose arrays live where ``rt`` computes; ``kind``: 'splitk' / 'tiled' / 'mma' / None
    (auto: :func:`default_kind`); ``mma_options``: ``op`` / ``split`` of :func:`moe_gemm_mma.run_moe_gemm_mma`."""
    check_moe_gemm(x, w, sorted_ids, expert_ids, block_m, top_k, topk_weights, x_is_slots)
    n_slots = x.shape[0] if x_is_slots else x.shape[0] * top_k
    if kind is None:
        kind = default_kind(rt, w.fmt, n_slots <= DECODE_SLOTS_PER_EXPERT * w.shape[0] and block_m in BLOCK_MS["splitk"])
    contract("moe_gemm", kind == "mma" or not mma.mma_pack.packing(w),
             f"kernel {kind!r} reads the stored layout; these codes are packed for the tensor-core kernel (kind='mma')")
    if kind == "mma":
        return mma.run_moe_gemm_mma(rt, x, w, sorted_ids, expert_ids, block_m, top_k, topk_weights, x_is_slots, **mma_options)
    E, N, K = w.shape
    out = rt.xp.zeros((n_slots, N), np.float32)  # [T*A, N]
    n_blocks = int(expert_ids.shape[0])
    if not n_blocks or not N:
        return out
    xf, xq, xs = x, NULL, NULL
    if w.fmt.act_quant is not None:  # W8A8: per-token e4m3 codes + scales
        xf, (xq, xs) = NULL, run_fp8_act_quant(rt, x)
    arrays = [w.arrays[name] for name in w.fmt.arrays(w.shape)]  # layout order: codes, then scales, biases
    ws = arrays[1] if len(arrays) > 1 else NULL
    wb = arrays[2] if len(arrays) > 2 else NULL
    tw = NULL if topk_weights is None else topk_weights
    contract("moe_gemm", block_m in BLOCK_MS.get(kind, ()), f"kernel {kind!r} is not built for block_m={block_m}")
    if kind == "splitk":
        row_blocks = -(-N // SK_WARPS)
        # blocks with an expert: at most min(E, slots) experts get slots, each wastes < block_m of its last block
        live = max(1, min(n_blocks, (n_slots + min(E, n_slots) * (block_m - 1)) // block_m))
        split = max(1, min(-(-TARGET_BLOCKS // (row_blocks * live)), -(-K // 256)))
        k_chunk = -(-K // split // 256) * 256
        grid, block = (row_blocks, n_blocks, -(-K // k_chunk)), (32 * SK_WARPS,)
    else:
        k_chunk, grid, block = K, (-(-N // TN), n_blocks), (TILE_THREADS,)
    group = w.fmt.group_size or K
    rt.launch(SOURCE, kernel_name(kind, w.fmt, block_m), grid, block,
              (xf, xq, xs, arrays[0], ws, wb, sorted_ids, expert_ids, tw, out, np.int32(n_slots), np.int32(top_k),
               np.int32(bool(x_is_slots)), np.int32(N), np.int32(K), np.int32(group), np.int32(k_chunk)))
    return out

