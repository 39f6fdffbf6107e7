"""cuda moe_gemm on tensor cores: launcher of ``cuda_src/moe_gemm_mma.cu`` (``run_moe_gemm(kind="mma")``).

The same op as :mod:`toolkit.gpu.moe_gemm` (``x f32 [T or T*A, K]``, ``w`` QTensor ``[E, N, K]``, the moe_align
layout -> ``out f32 [T*A, N]``), computed with ``mma.sync``:

- operand type ``op``: ``"f16"`` (default) or ``"bf16"``: the activations are rounded to it once (``to_op``), the
  weights decoded and rounded to it per block, products summed in f32; W8A8 formats (fp8) use the e4m3 MMA on
  the stored weight codes and fp8_act_quant's per-token codes (sm_89+, ``E4M3_MIN_ARCH``), scales in the epilogue.
- ``split``: K split over ``gridDim.z`` into f32 partials ``[split, slots, N]``, summed in a fixed order by the
  ``splitk_sum`` kernel (no atomics: the result is the same run to run; a kernel, so recorded steps replay it).
  Chosen from the device's resident blocks (``Device.resident_blocks``: the driver's occupancy on a GPU) so the
  last wave of a decode step is full (:func:`split_for`).
- ``block_m``: the M-block of moe_align (16, 64 or 128), chosen by the caller; :func:`block_m_for` is the table
  the model path uses (vLLM keeps such tables per device in JSON; ours is one rule until a GPU tunes it). Blocks of
  16 and 64 tokens cover 64 weight rows (4 warps of 16 rows); 128 tokens (prefill) cover 128 weight rows with 4 warps
  of 64 x 64 in 62-74 KB of dynamic shared memory (:func:`tile_rows`, :func:`dynamic_smem`).
"""
from __future__ import annotations

import os

import numpy as np

from . import mma_pack
from . import moe_gemm_wgmma as wgmma
from .fp8_act_quant import run_fp8_act_quant
from .contract import NULL, contract

SOURCE = "moe_gemm_mma"
OPS = {"f16": "OpF16", "bf16": "OpBf16"}  # operand type -> mma.cuh struct (2-byte elements)
E4M3_MIN_ARCH = 890  # mma.sync ... .e4m3.e4m3: sm_89 (Ada) and later
BLOCK_MS = (16, 64, 128)
THREADS, TN, KB = 128, 64, 128  # cuda_src/moe_gemm_mma.cu: MMA_THREADS, MMA_TN, KB (bytes of K per k-tile)
WIDE_BM, WIDE_TN = 128, 128  # MmaTile<128>: 128 weight rows a block
WIDE_I8_STAGES = 3  # cuda_src/moe_gemm_mma.cu: cp.async stages of DIRECT_A at block_m 128 (the other packed codes: 2)
# block_m 128's decoders whose warps make their A fragments from the codes (moe_gemm_mma.cu DirectA) -> (code bits,
# side bytes a stage: 2 sub-tiles x 2 halves of a k-tile x 64 rows x an f16 scale or a scale-bias word; int8's row
# scale is applied in the epilogue)
DIRECT_A = {"Int8Dec": (8, 0), **{d: (mma_pack.CODE_BITS[d], 2 * 2 * 64 * mma_pack.SIDE_BYTES[d][0])
                                    for d in ("Q8_0PackedDec", "AffinePackedDec<4>", "Q4_0PackedDec", "Mxfp4PackedDec")}}
BLOCK_OVERHEAD_TILES = 2  # a block's fixed cost in k-tiles of its main loop (split_for's model; tuned on no GPU yet)
MIN_BLOCKS = {16: 4, 64: 3, 128: 2}  # cuda_src/moe_gemm_mma.cu MmaTile::MIN_BLOCKS: __launch_bounds__, by block_m
CONVERT_THREADS = 256
BF16_DECODERS = ("Int8Dec", "AffineDec<4>")  # int8 and int4 (any group) also built with bf16 operands
ROW_RING_TILES = 2  # cuda_src/moe_gemm_mma.cu: k-tiles of int8 W8A16 codes (stored layout) fetched ahead
# decoders built at block_m 128 too (f16 operands): the packed codes (loaded into registers and decoded into a tile
# a k-tile ahead, or for DIRECT_A read into A fragments by each warp) and int8 W8A16 (the same). Not the stored sub-byte and
# GGML decoders, f32, bf16 operands or e4m3: at 64 x 64 warp tiles their decode (e4m3 on sm_90: ptxas makes each
# mma.sync two f16 HMMA on converted fragments into temporaries, then adds: occupancy.MMA_SYNC_FLOP_PER_CYCLE) left
# ptxas spilling at 255 registers
WIDE_DECODERS = (*mma_pack.RING_TILES, "Int8Dec")


def _decoders():
    from ..formats import FORMATS

    return {f.name: f.cuda_decoder for f in FORMATS.values() if f.cuda_decoder}


def kernel_name(dec: str, op: str, block_m: int) -> str:
    return f"moe_gemm_mma<{dec}, {op}, {block_m}>"


def _block_ms(dec: str, op: str) -> tuple[int, ...]:
    """block_m built for a decoder and operand: 128 (64 x 64 warp tiles, 128 accumulators a thread) only where the
    decode fits beside the accumulators without spilling under both NVRTC generations (WIDE_DECODERS)."""
    return BLOCK_MS if dec in WIDE_DECODERS and op == "OpF16" else BLOCK_MS[:-1]


def _kernels() -> tuple[str, ...]:
    from ..formats import FORMATS

    names = []
    for f in FORMATS.values():
        if not f.cuda_decoder:
            continue
        ops = ["OpE4m3"] if f.act_quant is not None else ["OpF16", "OpBf16"] if f.cuda_decoder in BF16_DECODERS else ["OpF16"]
        names += [kernel_name(f.cuda_decoder, op, bm) for op in ops for bm in _block_ms(f.cuda_decoder, op)]
    # codes repacked at upload (toolkit/gpu/mma_pack.py): wide loads, fetched mma_pack.RING_TILES k-tiles ahead
    names += [kernel_name(dec, "OpF16", bm) for dec in mma_pack.RING_TILES for bm in _block_ms(dec, "OpF16")]
    return tuple(dict.fromkeys(names)) + tuple(f"to_op<{op}>" for op in OPS.values()) + ("splitk_sum",)


KERNELS = _kernels()


def tensor_cores(rt) -> bool:
    """Whether the device has tensor cores (sm_80+) and they are not switched off with
    ``MOQE_CUDA_TENSOR_CORES=0`` (the f32 kernels then run everything: results to f32 summation order, as the
    whole-model GPU tests compare them with the NumPy backend)."""
    return (arch_of(rt) or 0) >= 800 and os.environ.get("MOQE_CUDA_TENSOR_CORES", "1") != "0"


def arch_of(rt) -> int | None:
    """The compute capability the device's kernels run at (e.g. 900), or None when unknown (the emulated
    device's default, whose build has every emulated instruction)."""
    return getattr(rt, "arch", None)


def supports(rt, fmt) -> bool:
    """Whether the MMA kernel runs ``fmt`` on this device (an instantiation exists, and e4m3 MMA for W8A8)."""
    dec = _decoders().get(fmt.name)
    if dec is None:
        return False
    if fmt.act_quant is not None:
        a = arch_of(rt)
        return a is None or a >= E4M3_MIN_ARCH
    return True


def tile_rows(block_m: int) -> int:
    """Weight rows of one block (MmaTile<BM>::TN)."""
    return WIDE_TN if block_m >= WIDE_BM else TN


def dynamic_smem(block_m: int, dec: str) -> int:
    """Bytes of dynamic shared memory a block of ``block_m`` takes with decoder ``dec`` (moe_gemm_mma.cu
    wide_smem_bytes): codes packed at upload, 2 stages of 128 token rows and 2 buffers of 128 decoded weight rows, KB
    bytes each (their codes are loaded into registers); int8 W8A16, q8_0 and the 4-bit codes of int4, q4_0
    and mxfp4 (``DIRECT_A``: their warps read their A fragments from the codes), ``WIDE_I8_STAGES`` stages of 128 token
    rows of KB bytes, 128 rows of a k-tile's codes and their sides; 0 at 16 and 64 (static)."""
    if block_m < WIDE_BM:
        return 0
    if dec in DIRECT_A:
        bits, side = DIRECT_A[dec]
        return WIDE_I8_STAGES * (block_m * KB + WIDE_TN * KB // 2 * bits // 8 + side)
    if dec in mma_pack.CODE_BITS:
        return 2 * (block_m + WIDE_TN) * KB
    return 0  # no block_m 128 build (run_moe_gemm_mma refuses the launch by its name)


def decoder_of(w) -> str:
    """The decoder that reads ``w``: its format's, or the packed one where its codes were repacked at upload."""
    return mma_pack.decoder(w.fmt) if mma_pack.packing(w) else _decoders()[w.fmt.name]


def kernel_for(w, op: str = "f16", block_m: int = 16) -> str:
    """The instantiation that runs ``w`` (as stored, or packed at upload) with ``op`` operands at ``block_m``."""
    return kernel_name(decoder_of(w), "OpE4m3" if w.fmt.act_quant is not None else OPS[op], block_m)


def has_wide(rt, w) -> bool:
    """Whether ``w`` runs on this device's tensor cores with 128-token blocks (block_m_for's ``wide``): this kernel's
    128 instantiations, or e4m3 experts on sm_90's wgmma (:mod:`toolkit.gpu.moe_gemm_wgmma`)."""
    if not (tensor_cores(rt) and supports(rt, w.fmt)):
        return False
    return kernel_for(w, block_m=WIDE_BM) in KERNELS or wgmma.runs(rt, w, run_moe_gemm_mma)


def on_wgmma(w, block_m: int) -> bool:
    """Whether ``run_moe_gemm_mma`` hands ``w`` at ``block_m`` to the wgmma kernel (e4m3 experts, 128-token blocks)."""
    return w.fmt.act_quant is not None and block_m == WIDE_BM


def block_m_for(slots: int, n_experts: int, wide: bool = False) -> int:
    """moe_align's block size for ``slots`` routed rows over ``n_experts``: 16 while an expert gets few rows
    (decode: less padding), 64 once the average expert fills most of a 64-row block (prefill: 4x the weight reuse),
    and with ``wide`` (both GEMMs run on this kernel at 128: :func:`has_wide`; the other kernels stop at 64)
    128 once it fills most of a 128-row block (64 x 64 warp tiles: the prefill tiling of
    ``toolkit.gpu.occupancy.prefill_table`` past 60 % of the dense peak)."""
    if wide and slots >= 96 * n_experts:
        return 128
    return 64 if slots >= 48 * n_experts else 16


def split_for(live_blocks: int, n_tiles_n: int, K: int, elem_bytes: int, slots: int, align: int = 1) -> tuple[int, int]:
    """(split, k_chunk) for a grid of ``live_blocks x n_tiles_n`` blocks on a GPU that runs ``slots`` at once (SMs x
    resident blocks per SM). A grid that fills the slots is not split. One that does not (decode) is split so
    that the waves it runs take the least time, a wave being as long as a block's k-tiles plus
    ``BLOCK_OVERHEAD_TILES`` (filling the ring and the pipeline, writing the partials): ``ceil(blocks * split /
    slots) * (ceil(tiles / split) + 2)``, the fewest splits on a tie, at least 4 k-tiles per split. The last wave
    is then as full as the split can make it (Mixtral's GEMM2 at M = 1: 128 blocks on 528 slots, 4 splits of 56
    k-tiles in one wave). ``align``: k-tiles a chunk is a multiple of (:func:`k_align`)."""
    ke = KB // elem_bytes * align  # K per unit of the split (align k-tiles)
    units = -(-K // ke)
    blocks = max(1, live_blocks * n_tiles_n)
    split = 1
    if blocks < slots:
        cost = lambda s: -(-blocks * s // slots) * (-(-units // s) * align + BLOCK_OVERHEAD_TILES)  # noqa: E731
        split = min(range(1, max(1, min(units, units * align // 4)) + 1), key=lambda s: (cost(s), s))
    k_chunk = -(-units // split) * ke
    return -(-K // k_chunk), k_chunk


def k_align(w) -> int:
    """k-tiles a K split's chunk must be a multiple of: q2_K packed at upload, 4 (a super-block of 256: the kernel
    loads a super-block's factors once, from its first k-tile); else 1."""
    return mma_pack.SUPER // mma_pack.TILE if mma_pack.packing(w) and mma_pack.keeps_factors(w.fmt) else 1


def run_moe_gemm_mma(rt, x, w, sorted_ids, expert_ids, block_m, top_k, topk_weights=None, x_is_slots=False,
                     op: str = "f16", split: int | None = None, silu: bool = False, zero_fill: bool = False):
    """Checked by the caller (toolkit.gpu.moe_gemm.check_moe_gemm); ``split`` None: :func:`split_for`.
    ``silu``: GEMM1 with silu_and_mul in its epilogue: ``w`` is gate_up ``[E, 2I, K]`` and the result is
    ``h = silu(gate) * up`` ``f32 [T*A, I]`` (no K split: the activation needs whole sums). ``zero_fill``: slots
    in no block (fused_moe's expert_map -1 slots) come out as zeros; without it the layout must cover every slot."""
    E, N, K = w.shape
    packed = mma_pack.packing(w)  # None, "natural" or "halves" (codes repacked at upload)
    if silu:
        contract("moe_gemm", N % 2 == 0 and topk_weights is None, f"silu needs gate_up rows [E, 2I, K] (got N={N}) "
                 "and no routing weight")
    contract("moe_gemm", not (silu and packed == "natural"), "silu needs gate_up packed with halves (mma_pack.pack)")
    mode = 2 if silu else 1 if packed == "halves" else 0  # the kernel's row mapping / epilogue
    n_slots = x.shape[0] if x_is_slots else x.shape[0] * top_k
    n_blocks = int(expert_ids.shape[0])
    dec = decoder_of(w)
    contract("moe_gemm", block_m in BLOCK_MS, f"the MMA kernel is built for block_m in {BLOCK_MS}, got {block_m}")
    if w.fmt.act_quant is not None:
        contract("moe_gemm", supports(rt, w.fmt), f"format {w.fmt.name!r} needs the e4m3 MMA (sm_89+), "
                 f"this device is sm_{(arch_of(rt) or 0) // 10}")
        opname, elem = "OpE4m3", 1
    else:
        contract("moe_gemm", op in OPS, f"operand type {op!r}: one of {list(OPS)}")
        opname, elem = OPS[op], 2
    # the kernel: e4m3 at block_m 128 on wgmma (sm_90), the rest on this one's instantiations
    stem, name, threads, tn, smem, min_blocks = (SOURCE, kernel_name(dec, opname, block_m), THREADS,
                                                 tile_rows(block_m), dynamic_smem(block_m, dec), MIN_BLOCKS[block_m])
    if on_wgmma(w, block_m):
        why = wgmma.why_not(rt, w, block_m, mode, run_moe_gemm_mma)
        contract("moe_gemm", why is None, f"e4m3 experts at block_m {WIDE_BM} run on wgmma (sm_90), not here: {why}")
        stem, name, threads, tn, smem, min_blocks = (wgmma.SOURCE, wgmma.KERNEL, wgmma.THREADS, wgmma.TN, wgmma.SMEM,
                                                     wgmma.MIN_BLOCKS)
    contract("moe_gemm", stem != SOURCE or name in KERNELS, f"no MMA instantiation {name} (operand bf16 is built for "
             f"int8 and int4{'; packed codes take f16' if packed else ''}; block_m {WIDE_BM} for f16 operands of int8 "
             "and of the codes packed at upload, and e4m3 on sm_90)")
    if w.fmt.act_quant is not None:
        xa, xs = run_fp8_act_quant(rt, x)  # [rows, K] codes, [rows] scales
    else:
        xa = rt.xp.empty(x.shape, np.uint16)  # [rows, K] in the operand type
        pairs = x.size // 2
        if pairs:
            rt.launch(SOURCE, f"to_op<{opname}>", (min(4096, -(-pairs // CONVERT_THREADS)),), (CONVERT_THREADS,),
                      (x, xa, np.int64(pairs)))
        xs = NULL
    n_tiles_n = -(-(N // 2) // (tn // 2)) if mode else -(-N // tn)
    live = max(1, min(n_blocks, (n_slots + min(E, n_slots) * (block_m - 1)) // block_m))
    if silu:
        split, k_chunk = 1, K
    elif split is None:
        slots = rt.sm_count * rt.resident_blocks(stem, name, threads, min_blocks, smem)
        split, k_chunk = split_for(live, n_tiles_n, K, elem, slots, k_align(w))
    else:
        ke = KB // elem * k_align(w)
        k_chunk = -(-(-(-K // ke)) // split) * ke
        split = -(-K // k_chunk)
    launch = bool(n_blocks and N and n_slots)
    n_out = N // 2 if silu else N
    # every entry written by the kernel when every slot is in a block (always, unless zero_fill says otherwise)
    parts = (rt.xp.empty if launch and not zero_fill else rt.xp.zeros)((split, n_slots, n_out), np.float32)
    if launch:
        arrays = mma_pack.kernel_arrays(w)  # codes (or packed codes), then scales, biases
        ws = arrays[1] if len(arrays) > 1 else NULL
        wb = arrays[2] if len(arrays) > 2 else NULL
        tw = NULL if topk_weights is None else topk_weights
        group = (mma_pack.side_group(w.fmt) if mma_pack.packing(w) else w.fmt.group_size) or K
        rt.launch(stem, name, (n_blocks, n_tiles_n, split), (threads,),
                  (xa, xs, arrays[0], ws, wb, sorted_ids, expert_ids, tw, parts, np.int32(n_slots), np.int32(top_k),
                   np.int32(bool(x_is_slots)), np.int32(N), np.int32(K), np.int32(group), np.int32(k_chunk),
                   np.int32(mode)), shared_mem=smem)
    if split == 1:
        return parts.reshape(n_slots, n_out)
    out = rt.xp.empty((n_slots, n_out), np.float32)  # [T*A, N]: the partials summed in split order, by a kernel
    n = n_slots * n_out
    rt.launch(SOURCE, "splitk_sum", (min(4096, -(-n // CONVERT_THREADS)),), (CONVERT_THREADS,),
              (parts, out, np.int64(n), np.int32(split)))
    return out
