"""Occupancy and weight bytes in flight, computed from a kernel's registers and shared memory (NVRTC's ptxas figures,
``toolkit.gpu.nvrtc``; no GPU needed).

A decode step is memory-bound: by Little's law the bytes a GPU keeps in flight must cover bandwidth x latency. To
stream 70 % of an H200's 4.8 TB/s with 600-800 ns of memory latency takes 2-3 MB in flight, about 20-25 KB per SM
(``TARGET_INFLIGHT``). ``resident_blocks`` is the CUDA occupancy rule (registers allocated per warp in units of
256, shared memory per block rounded to 128 bytes plus the 1 KB the runtime reserves per block, the SM's thread and
block limits); ``decode_inflight`` multiplies it by the weight bytes one block of ``moe_gemm_mma`` keeps in flight
at decode (block_m 16). ``python -m toolkit.gpu.occupancy`` prints the table for sm_80 and sm_90.

Shapes: ``regs`` registers per thread, ``smem`` static shared bytes per block, ``threads`` per block.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SM:
    """One streaming multiprocessor's limits (CUDA C programming guide, compute capability tables)."""

    name: str
    smem: int  # shared memory per SM available to blocks, bytes
    count: int  # SMs on the reference part
    regs: int = 65536
    threads: int = 2048
    blocks: int = 32
    smem_reserved: int = 1024  # per block, sm_80+
    reg_unit: int = 256  # registers are allocated per warp in units of this


SMS = {80: SM("A100 (sm_80)", smem=164 * 1024, count=108), 90: SM("H200 (sm_90)", smem=228 * 1024, count=132)}
TARGET_INFLIGHT = 24 * 1024  # weight bytes in flight per SM that a decode kernel should reach (issue 36)


def resident_blocks(regs: int, smem: int, threads: int, sm: SM) -> int:
    """Blocks of ``threads`` threads that fit on one SM at ``regs`` registers per thread and ``smem`` bytes of shared
    memory per block."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // sm.reg_unit) * sm.reg_unit
    by_regs = (sm.regs // per_warp) // warps if per_warp else sm.blocks
    by_smem = sm.smem // (-(-smem // 128) * 128 + sm.smem_reserved)
    by_threads = sm.threads // (warps * 32)
    return max(0, min(by_regs, by_smem, by_threads, sm.blocks))


def decode_inflight(fmt, regs: int, smem: int, sm: SM, packed: bool = False, ring_tiles: int = 1) -> dict:
    """moe_gemm_mma at block_m 16 (one decode token per expert): weight bytes one block keeps in flight, resident
    blocks and the bytes in flight per SM. A block holds one k-tile of its 64 weight rows in flight (the next tile's
    loads are issued before the current tile's MMAs): ``64 x KE`` weights at the format's stored bits per weight
    (scales included), KE = 64 elements for f16/bf16 operands; W8A8 (e4m3 operands, KE = 128 bytes) streams its
    weights with cp.async, one stage ahead. ``packed`` (affine codes repacked at upload): the codes of the next
    ``PACKED_RING_WORDS / bits`` k-tiles are fetched ahead, plus one tile's scales and offsets. ``ring_tiles``:
    k-tiles of stored codes fetched ahead (int8 W8A16: ``ROW_RING_TILES``)."""
    from .moe_gemm_mma import KB, PACKED_RING_WORDS, THREADS, TN

    KE = KB // 2  # f16 / bf16 operand elements per k-tile
    if fmt.act_quant is not None:  # e4m3 codes, cp.async'ed: one 64 x 128-byte stage ahead
        per_block = TN * KB
    elif packed:
        codes = TN * KE * fmt.bits // 8
        per_block = PACKED_RING_WORDS // fmt.bits * codes + TN * KE * (fmt.bits_per_weight((4096, 4096)) - fmt.bits) / 8
    else:
        per_block = ring_tiles * TN * KE * fmt.bits_per_weight((4096, 4096)) / 8
    blocks = resident_blocks(regs, smem, THREADS, sm)
    return {"per block": int(per_block), "blocks/SM": blocks, "per SM": int(per_block * blocks)}


def table(arch: int) -> list[dict]:
    """One row per format the tensor-core GEMM runs: its block_m 16 kernel's registers and shared memory (NVRTC),
    resident blocks, weight bytes in flight per block and per SM, and against ``TARGET_INFLIGHT``."""
    from ..formats import FORMATS
    from . import nvrtc
    from .moe_gemm_mma import KERNELS, PACKED_BITS, ROW_RING_TILES, kernel_name

    infos = {k.kernel: k for k in nvrtc.compile_stem("moe_gemm_mma", arch).kernels}
    sm, rows = SMS[arch], []
    for f in FORMATS.values():
        if not f.cuda_decoder:
            continue
        op = "OpE4m3" if f.act_quant is not None else "OpF16"
        packed = f.cuda_decoder.startswith("AffineDec<") and f.bits in PACKED_BITS  # repacked at upload (mma_pack)
        decs = [f"AffinePackedDec<{f.bits}>"] if packed else [f.cuda_decoder]
        for dec in decs:
            name = kernel_name(dec, op, 16)
            if name not in KERNELS:
                continue
            k = infos[name]
            r = decode_inflight(f, k.registers, k.smem, sm, packed=dec.startswith("AffinePacked"),
                                ring_tiles=ROW_RING_TILES if dec == "Int8Dec" and op == "OpF16" else 1)
            rows.append({"format": f.name, "kernel": name, "regs": k.registers, "smem": k.smem, **r,
                         "of target": round(r["per SM"] / TARGET_INFLIGHT, 2)})
    return rows


if __name__ == "__main__":
    from ..bench.timing import print_table

    for a in sorted(SMS):
        print_table(table(a), f"moe_gemm_mma decode (block_m 16) weight bytes in flight, {SMS[a].name}, "
                              f"target {TARGET_INFLIGHT // 1024} KB per SM")
