"""Occupancy and weight bytes in flight, computed from a kernel's registers and shared memory (NVRTC's ptxas figures,
``toolkit.gpu.nvrtc``; no GPU needed).

A decode step is memory-bound: by Little's law the bytes a GPU keeps in flight must cover bandwidth x latency. To
stream 70 % of an H200's 4.8 TB/s with 600-800 ns of memory latency takes 2-3 MB in flight, about 20-25 KB per SM
(``TARGET_INFLIGHT``). ``resident_blocks`` is the CUDA occupancy rule (registers allocated per warp in units of
256, shared memory per block rounded to 128 bytes plus the 1 KB the runtime reserves per block, the SM's thread and
block limits); ``decode_inflight`` multiplies it by the weight bytes one block of ``moe_gemm_mma`` keeps in flight
at decode (block_m 16). Streaming also needs the SM to issue the decode's instructions as fast as the bytes arrive:
``decode_issue`` counts the main loop's instructions per k-tile (SASS where ``nvdisasm`` is installed, else PTX)
and gives the share of HBM bandwidth at which instruction issue, not memory, becomes the limit (``TARGET_HBM``:
0.7). ``python -m toolkit.gpu.occupancy`` prints the table for sm_80 and sm_90 (``--image``: under the GPU
image's NVRTC).

Shapes: ``regs`` registers per thread, ``smem`` static shared bytes per block, ``threads`` per block.
"""
from __future__ import annotations

import re
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
    clock_ghz: float = 1.41  # boost clock of the reference part
    hbm_tbs: float = 2.04  # its memory bandwidth (data sheet), TB/s
    issue: int = 4  # warp instructions an SM issues per cycle (one per scheduler)


SMS = {80: SM("A100 (sm_80)", smem=164 * 1024, count=108, clock_ghz=1.41, hbm_tbs=2.04),
       90: SM("H200 (sm_90)", smem=228 * 1024, count=132, clock_ghz=1.98, hbm_tbs=4.8)}
TARGET_INFLIGHT = 24 * 1024  # weight bytes in flight per SM that a decode kernel should reach (issue 36)
TARGET_HBM = 0.7  # the share of HBM bandwidth decode should stream at (issue 36)
_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BACK = re.compile(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def main_loop(ptx: str) -> tuple[int, list[str]]:
    """(mma.sync count, instructions) of a kernel's main loop: the PTX loop (a label and a branch back to it)
    holding the most mma.sync instructions (``nvrtc.main_loop``, which reads the SASS the same way)."""
    from .nvrtc import main_loop as listing_loop

    def instruction(line: str) -> bool:
        x = line.strip()
        return x.endswith(";") and not x.startswith(("//", "."))

    return listing_loop(ptx.splitlines(), _LABEL, _BACK, instruction, "mma.sync")


def decode_issue(fmt, info, sm: SM, packed: str | None = None) -> dict:
    """Whether decode at block_m 16 can issue its instructions as fast as HBM delivers the weights: the main loop's
    instructions per thread per k-tile, against the SM's issue rate. Counted in the SASS where NVRTC's cubin was
    disassembled (``info.sass_loop``, :func:`toolkit.gpu.nvrtc.nvdisasm`), else in the PTX (with ptxas 13.0 at
    sm_90 the PTX was 5-25 % above the SASS before f16 packs were folded into operand selects; now up to 50 %).
    A k-tile of a block is ``64 x KE`` weights at the format's bits (as packed) and 4 warps x ``instr`` warp
    instructions, so instruction issue caps the stream at ``SMs x clock x bytes / instr`` (4 schedulers, 4 warps:
    the warp count cancels). ``instr at HBM``: the instructions a k-tile at which issue keeps up with HBM exactly
    (``SMs x clock x 4 x tile bytes / (4 x HBM bytes/s)``, sm_90: int2's 2.5 bits a weight allow 70, int4's 4.5
    allow 125).
    ``info``: the kernel's :class:`toolkit.gpu.nvrtc.KernelInfo`."""
    from . import mma_pack
    from .moe_gemm_mma import KB, TN

    n_mma, body = main_loop(info.ptx)
    if not n_mma:  # no MMA at this architecture (e4m3 before sm_89)
        return {"instr/tile": "-", "counted": "-", "issue cap of HBM": "-", "instr at HBM": "-"}
    tiles = n_mma / (KB // 32 * 2)  # 4 MMA k-steps x 2 token tiles per k-tile at block_m 16
    # the SASS loop is the PTX loop when its HMMAs are a whole number per mma.sync (e4m3 on sm_90: 2)
    sass = info.sass_mma > 0 and info.sass_mma % n_mma == 0
    per_tile = (info.sass_loop if sass else len(body)) / tiles
    KE = KB // (1 if fmt.act_quant is not None else 2)
    bits = mma_pack.code_bits(fmt) + mma_pack.side_bits(fmt) if packed else fmt.bits_per_weight((4096, 4096))
    tile_bytes = TN * KE * bits / 8
    cap = sm.count * sm.clock_ghz * 1e9 * tile_bytes * sm.issue / (4 * per_tile) / 1e12  # TB/s
    return {"instr/tile": round(per_tile), "counted": "SASS" if sass else "PTX",
            "issue cap of HBM": round(cap / sm.hbm_tbs, 2), "instr at HBM": round(per_tile * cap / sm.hbm_tbs)}


def resident_blocks(regs: int, smem: int, threads: int, sm: SM) -> int:
    """Blocks of ``threads`` threads that fit on one SM at ``regs`` registers per thread and ``smem`` bytes of shared
    memory per block."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // sm.reg_unit) * sm.reg_unit
    by_regs = (sm.regs // per_warp) // warps if per_warp else sm.blocks
    by_smem = sm.smem // (-(-smem // 128) * 128 + sm.smem_reserved)
    by_threads = sm.threads // (warps * 32)
    return max(0, min(by_regs, by_smem, by_threads, sm.blocks))


def decode_inflight(fmt, regs: int, smem: int, sm: SM, packed: str | None = None, ring_tiles: int = 1) -> dict:
    """moe_gemm_mma at block_m 16 (one decode token per expert): weight bytes one block keeps in flight, resident
    blocks and the bytes in flight per SM. A block holds one k-tile of its 64 weight rows in flight (the next tile's
    loads are issued before the current tile's MMAs): ``64 x KE`` weights at the format's stored bits per weight
    (scales included), KE = 64 elements for f16/bf16 operands; W8A8 (e4m3 operands, KE = 128 bytes) streams its
    weights with cp.async, one stage ahead. ``packed`` (the packed decoder of codes repacked at upload,
    ``mma_pack``): the codes of the next ``mma_pack.RING_TILES[packed]`` k-tiles are fetched ahead, and the scales
    and offsets of the next ``mma_pack.side_ring(packed)``. ``ring_tiles``: k-tiles of stored codes fetched ahead (int8 W8A16:
    ``ROW_RING_TILES``). A ring slot is refilled once its tile is decoded, before that tile's MMAs: the count is
    what is in flight while the MMAs run (one tile fewer during a decode)."""
    from . import mma_pack
    from .moe_gemm_mma import KB, THREADS, TN

    KE = KB // 2  # f16 / bf16 operand elements per k-tile
    if fmt.act_quant is not None:  # e4m3 codes, cp.async'ed: one 64 x 128-byte stage ahead
        per_block = TN * KB
    elif packed:
        codes = TN * KE * mma_pack.code_bits(fmt) // 8
        per_block = (mma_pack.RING_TILES[packed] * codes +
                     mma_pack.side_ring(packed) * TN * KE * mma_pack.side_bits(fmt) / 8)
    else:
        per_block = ring_tiles * TN * KE * fmt.bits_per_weight((4096, 4096)) / 8
    blocks = resident_blocks(regs, smem, THREADS, sm)
    return {"per block": int(per_block), "blocks/SM": blocks, "per SM": int(per_block * blocks)}


def table(arch: int, infos: dict | None = None) -> list[dict]:
    """One row per format the tensor-core GEMM runs: its block_m 16 kernel's registers and shared memory (NVRTC),
    resident blocks, weight bytes in flight per block and per SM, and against ``TARGET_INFLIGHT``. ``infos``:
    kernel name -> :class:`toolkit.gpu.nvrtc.KernelInfo` of moe_gemm_mma at ``arch`` from another NVRTC (the GPU
    image's: ``nvrtc.compile_with``); None: the installed one's."""
    from ..formats import FORMATS
    from . import nvrtc
    from . import mma_pack
    from .moe_gemm_mma import KERNELS, ROW_RING_TILES, kernel_name

    if infos is None:
        infos = {k.kernel: k for k in nvrtc.compile_stem("moe_gemm_mma", arch).kernels}
    sm, rows = SMS[arch], []
    for f in FORMATS.values():
        if not f.cuda_decoder:
            continue
        op = "OpE4m3" if f.act_quant is not None else "OpF16"
        packed = mma_pack.decoder(f)  # repacked at upload: the kernel that runs it on a GPU with tensor cores
        dec = packed or f.cuda_decoder
        name = kernel_name(dec, op, 16)
        if name not in KERNELS:
            continue
        k = infos[name]
        r = decode_inflight(f, k.registers, k.smem, sm, packed=packed,
                            ring_tiles=ROW_RING_TILES if dec == "Int8Dec" and op == "OpF16" else 1)
        rows.append({"format": f.name, "kernel": name, "regs": k.registers, "smem": k.smem, **r,
                     "of target": round(r["per SM"] / TARGET_INFLIGHT, 2), **decode_issue(f, k, sm, packed)})
    return rows


# ---- prefill: the shared-memory ceiling of a tile shape -------------------------------------------------------
SMEM_BYTES_PER_CYCLE = 128  # shared memory bandwidth of an SM (sm_80, sm_90): 32 banks x 4 bytes
DENSE_FLOP_PER_CYCLE = {(80, "f16"): 2048, (90, "f16"): 4096, (90, "fp8"): 8192}  # tensor-core peak per SM, dense
DENSE_TFLOPS = {(80, "f16"): 312, (90, "f16"): 989, (90, "fp8"): 1979}  # the reference parts' data sheets, dense
# what mma.sync itself reaches where it is below the dense peak: on sm_90 ptxas lowers mma.sync ... e4m3 to f16
# HMMA.16816 (two per m16n8k32, each on fragments converted by F2FP.F16.E4M3.UNPACK_B into a zeroed temporary, then
# FADDs into the accumulators; no QMMA: read in the SASS of ptxas 13.0 for sm_90), so fp8 through mma.sync runs at
# the f16 rate at best. The FP8 peak of Hopper is wgmma's
MMA_SYNC_FLOP_PER_CYCLE = {(90, "fp8"): 4096}


@dataclass(frozen=True)
class Tiling:
    """A block tile of ``rows`` weight rows x ``tokens`` tokens, computed by ``warps`` warps of ``warp_rows`` x
    ``warp_tokens`` each with mma.sync fragments loaded from shared memory by ldmatrix; or, with ``wgmma``, by
    ``warps`` warpgroups (128 threads) whose wgmma reads its ``warp_rows`` x ``warp_tokens`` operands from shared
    memory itself (the same bytes a k-step). ``codes``: the bits per weight of codes each warp makes its A fragments
    from itself (no decoded tile: the block copies ``rows`` rows of codes in; a warp's 2- or 4-byte loads of its rows'
    codes take the wavefronts ldmatrix of f16 rows would, ``warp_rows`` x 32 bytes a k-step); ``side``: shared bytes a
    k-step of their scales (copied in, and read back by each warp); ``decoders``: the moe_gemm_mma decoders built
    with this tiling and these codes at block_m 128 (:func:`prefill_kernels`)."""

    name: str
    rows: int
    tokens: int
    warps: int
    warp_rows: int
    warp_tokens: int
    built: tuple[str, ...] = ()  # the ops the kernel named runs with this tiling
    wgmma: bool = False
    codes: int = 0
    side: int = 0
    decoders: tuple[str, ...] = ()


# DIRECT_SIDE: a side of SIDE bytes a row a group, staged for a k-tile's 2 halves (a group each) and read by a
# warp's lanes for their 8 rows a group: 128 rows x SIDE bytes copied in a group (2 k-steps), and each warp's 2
# loads of 32 lanes x 4 SIDE bytes a group, counted as the wavefronts they request (an 8-byte load 2, a 16-byte 4:
# its lanes of one row share the bytes, but each phase of the load takes a wavefront): 64 SIDE + 4 x 128 SIDE = 576
# SIDE bytes a k-step
TILINGS = (
    Tiling("moe_gemm_mma block_m 64: 64 x 64, 4 warps of 16 x 64", 64, 64, 4, 16, 64, ("f16", "fp8")),
    Tiling("128 x 64, 4 warps of 32 x 64", 128, 64, 4, 32, 64),
    Tiling("128 x 128, 8 warps of 64 x 32", 128, 128, 8, 64, 32),
    Tiling("moe_gemm_mma block_m 128: 128 x 128, 4 warps of 64 x 64", 128, 128, 4, 64, 64, ("f16",)),
    Tiling("moe_gemm_mma block_m 128, int8 W8A16: 128 x 128, 4 warps of 64 x 64, A fragments from the codes", 128, 128,
           4, 64, 64, ("f16",), codes=8, decoders=("Int8Dec",)),
    # the codes packed at upload whose warps read them the same way, with a side a row a group of 32 or more (an f16
    # scale, or a scale-bias word: SIDE bytes) staged beside them: DIRECT_SIDE
    Tiling("moe_gemm_mma block_m 128, q8_0: 128 x 128, 4 warps of 64 x 64, A fragments from the codes, scales staged",
           128, 128, 4, 64, 64, ("f16",), codes=8, side=576 * 2, decoders=("Q8_0PackedDec",)),
    Tiling("moe_gemm_mma block_m 128, int4 / q4_1 / q4_K: 128 x 128, 4 warps of 64 x 64, A fragments from the codes, "
           "scale-bias words staged", 128, 128, 4, 64, 64, ("f16",), codes=4, side=576 * 4,
           decoders=("AffinePackedDec<4>",)),
    Tiling("moe_gemm_mma block_m 128, q4_0 / mxfp4: 128 x 128, 4 warps of 64 x 64, A fragments from the codes, scales "
           "staged", 128, 128, 4, 64, 64, ("f16",), codes=4, side=576 * 2,
           decoders=("Q4_0PackedDec", "Mxfp4PackedDec")),
    Tiling("256 x 128, 8 warps of 64 x 64", 256, 128, 8, 64, 64),
    Tiling("moe_gemm_wgmma: 128 x 128, 2 warpgroups of 64 x 128", 128, 128, 2, 64, 128, ("fp8",), wgmma=True),
)


def prefill_ceiling(t: Tiling, arch: int, op: str, loads: int = 0, what: str = "") -> dict:
    """Shared-memory bytes per MMA FLOP of one k-step (32 bytes of K: 16 f16 or 32 e4m3 elements) and the FLOP
    rate they allow: every warp reads its A (``warp_rows`` x 32 B) and B (``warp_tokens`` x 32 B) fragments by
    ldmatrix, the block writes its weight rows and token rows once (decoded weights or cp.async; the tiling's
    ``codes``: its rows' codes, ``rows x elements x codes / 8`` bytes), for ``2 x rows x tokens x elements`` FLOPs;
    ``loads``: bytes a k-step the block loads from global memory into registers (block_m 128's decoded codes and
    their sides: :func:`register_loads`), which pass the same L1 / shared-memory array once, as the wavefronts they
    return (``what`` names them in the row). Ceiling = 128 B/cycle / (bytes per FLOP), as a share of the SM's dense
    tensor peak.
    The ceiling is also capped by what mma.sync itself reaches (``MMA_SYNC_FLOP_PER_CYCLE``: fp8 on sm_90 at the f16
    rate; wgmma at the peak). Not modelled: the decode's ALU, latencies, the epilogue, the barrier a k-tile (and
    wgmma's wait a k-tile before its f32 sum)."""
    elements = 32 if op == "fp8" else 16
    rows_in = t.rows * elements * t.codes // 8 if t.codes else t.rows * 32
    smem = (t.warps * (t.warp_rows + t.warp_tokens) + t.tokens) * 32 + rows_in + t.side + loads
    per_flop = smem / (2 * t.rows * t.tokens * elements)
    ceiling = SMEM_BYTES_PER_CYCLE / per_flop
    peak = DENSE_FLOP_PER_CYCLE[(arch, op)]
    instr = peak if t.wgmma else MMA_SYNC_FLOP_PER_CYCLE.get((arch, op), peak)
    share = min(1.0, ceiling / peak, instr / peak)
    return {"tiling": t.name + (f", {what}" if what else ""), "op": op, "built": "yes" if op in t.built else "-",
            "smem B/FLOP": round(per_flop, 4), "smem cap": round(min(1.0, ceiling / peak), 2),
            "MMA cap": round(instr / peak, 2), "FLOP/cycle/SM": round(share * peak),
            "of dense peak": round(share, 2), "TFLOPS": round(share * DENSE_TFLOPS[(arch, op)]),
            "acc regs": t.warp_rows * t.warp_tokens // (128 if t.wgmma else 32)}

WIDE_TILING = next(t for t in TILINGS if t.name.startswith("moe_gemm_mma block_m 128:"))  # the decoded tile's

# block_m 128's decoders that store a decoded tile (their codes and sides loaded into registers a k-tile ahead)
WIDE_DECODED = {"Q6_KPackedDec": "q6_K", "Q5_0PackedDec": "q5_0", "Q5_1PackedDec": "q5_1 / q5_K",
                "AffinePackedDec<3>": "int3", "Q3_KPackedDec": "q3_K", "AffinePackedDec<2>": "int2",
                "Q2_KPackedDec": "q2_K"}


def register_loads(dec: str, rows: int = 128, elements: int = 16) -> int:
    """Bytes a k-step that block_m 128 with decoder ``dec`` loads from global memory into registers: its rows' codes
    (``rows x elements x bits / 8``: each thread's share of a sub-tile, ld.global.cg, no L1 line) and its sides: per
    warp and 64-row sub-tile one load of 32 lanes x 4 chunks' side bytes (and q2_K's super-block words), 8 such a
    k-tile of 4 k-steps, counted as the bytes the lanes request (``mma_pack.SIDE_BYTES``)."""
    from . import mma_pack

    side, sup = mma_pack.SIDE_BYTES[dec]
    return rows * elements * mma_pack.CODE_BITS[dec] // 8 + 64 * 4 * (side + sup)  # (4 warps x 2 x 32 lanes / 4)


def decoded_ceiling(dec: str, arch: int) -> dict:
    """:func:`prefill_ceiling` of block_m 128's decoded tile with ``dec``'s register loads."""
    return prefill_ceiling(WIDE_TILING, arch, "f16", register_loads(dec),
                           f"{WIDE_DECODED[dec]}: codes and sides loaded into registers")


def prefill_table(arch: int = 90) -> list[dict]:
    ops = [op for (a, op) in DENSE_FLOP_PER_CYCLE if a == arch]
    rows = [prefill_ceiling(t, arch, op) for op in ops for t in TILINGS
            if (not t.wgmma or arch == 90) and (not t.codes or op == "f16")]  # (codes: int8 W8A16's f16 operands)
    return rows + [decoded_ceiling(d, arch) for d in WIDE_DECODED]


# ---- prefill: what the block_m 128 kernels issue ------------------------------------------------------------
WIDE_HMMA_PER_TILE = 4 * 4 * 8  # per k-tile and warp at block_m 128: 4 k-steps x 4 A fragments x 8 token tiles
HMMA_FLOP = 2 * 16 * 8 * 16  # one mma.sync m16n8k16 (HMMA.16816)


def prefill_issue(info, arch: int) -> dict | None:
    """A block_m 128 kernel's SASS instructions a k-tile and warp, and the share of the dense f16 peak at which
    instruction issue caps its MMAs. A k-tile issues ``WIDE_HMMA_PER_TILE`` HMMA: the main loop holds them all
    where its k-steps are unrolled (int8), or one pass of a nested sub-tile loop that runs r times a k-tile (the
    packed codes: r = 1 + (128 - the main loop's HMMA) / the nested loop's), so a k-tile issues main + (r - 1) x
    nested instructions. A scheduler issues one instruction a cycle and its tensor core takes ``HMMA_FLOP`` / (dense
    FLOP/cycle/SM / 4) cycles an HMMA (sm_90: 4, sm_80: 8), so issue caps the MMAs at 128 x that / instructions (the
    warps a scheduler holds cancel). None without a SASS count (no nvdisasm), or where the HMMA do not add up.
    ``info``: the kernel's :class:`toolkit.gpu.nvrtc.KernelInfo`."""
    mma, loop, imma, inner = info.sass_mma, info.sass_loop, info.sass_inner_mma, info.sass_inner_loop
    more = (WIDE_HMMA_PER_TILE - mma) // imma if imma else 0  # passes of the nested loop beyond the listed one
    if not mma or mma + more * imma != WIDE_HMMA_PER_TILE:
        return None
    per_tile = loop + more * inner
    cycles = HMMA_FLOP / (DENSE_FLOP_PER_CYCLE[(arch, "f16")] / 4)
    return {"instr/k-tile": per_tile, "HMMA": WIDE_HMMA_PER_TILE,
            "issue cap": round(min(1.0, WIDE_HMMA_PER_TILE * cycles / per_tile), 2)}


def prefill_kernels(arch: int, infos: dict | None = None) -> list[dict]:
    """One row per block_m 128 kernel of moe_gemm_mma: registers, its tiling's shared-memory cap
    (:func:`prefill_ceiling`: the own tilings of the decoders whose warps read their codes, the decoded tile with
    the others' register loads: :func:`decoded_ceiling`), its issue cap (:func:`prefill_issue`) and the design
    ceiling, the lower of the two (share of the dense f16 peak). ``infos``: kernel name -> KernelInfo at ``arch``
    (another NVRTC's), None: the installed one's."""
    from . import nvrtc
    from .moe_gemm_mma import KERNELS

    if infos is None:
        infos = {k.kernel: k for k in nvrtc.compile_stem("moe_gemm_mma", arch).kernels}
    rows = []
    for name in KERNELS:
        if not name.endswith(", OpF16, 128>"):
            continue
        dec = name[len("moe_gemm_mma<"):-len(", OpF16, 128>")]
        own = next((t for t in TILINGS if dec in t.decoders), None)  # A fragments from the codes
        cap = (prefill_ceiling(own, arch, "f16") if own else decoded_ceiling(dec, arch))["of dense peak"]
        k = infos[name]
        issue = prefill_issue(k, arch) or {"instr/k-tile": "-", "HMMA": "-", "issue cap": None}
        ceiling = min(cap, issue["issue cap"]) if issue["issue cap"] is not None else None
        rows.append({"kernel": name, "regs": k.registers, "smem cap": cap, **issue, "design ceiling": ceiling})
    return rows


def _main(argv=None) -> None:
    import argparse

    from ..bench.timing import print_table
    from . import nvrtc

    ap = argparse.ArgumentParser(prog="python -m toolkit.gpu.occupancy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", action="store_true", help=f"compile with the GPU image's NVRTC {nvrtc.IMAGE_NVRTC} "
                    "(a child process; installed by .ci/test, or $MOQE_NVRTC_IMAGE_LIB) instead of the installed one")
    args = ap.parse_args(argv)
    infos, which = {a: None for a in SMS}, f"NVRTC {'.'.join(map(str, nvrtc.version()))}"
    if args.image:
        lib = nvrtc.image_nvrtc_dir()
        if lib is None:
            raise SystemExit(f"the GPU image's NVRTC {nvrtc.IMAGE_NVRTC} is not installed: pip install --no-deps "
                             f"--target .venv/nvrtc-{nvrtc.IMAGE_NVRTC} nvidia-cuda-nvrtc=={nvrtc.IMAGE_NVRTC}")
        version, results = nvrtc.compile_with(lib, ["moe_gemm_mma"], sorted(SMS))
        infos = {r.arch: {k.kernel: k for k in r.kernels} for r in results}
        which = f"NVRTC {'.'.join(map(str, version))} (the GPU image's)"
    for a in sorted(SMS):
        print_table(table(a, infos[a]), f"moe_gemm_mma decode (block_m 16) weight bytes in flight, {SMS[a].name}, "
                                        f"{which}, target {TARGET_INFLIGHT // 1024} KB per SM")
    print_table(prefill_table(90), f"prefill: shared-memory ceiling of tile shapes, {SMS[90].name} "
                                   f"({SMEM_BYTES_PER_CYCLE} B/cycle/SM; TFLOPS: the share of its data-sheet peak)")
    for a in sorted(SMS):
        print_table(prefill_kernels(a, infos[a]), f"prefill (block_m 128): SASS a k-tile and warp, issue and "
                                                  f"shared-memory caps, share of the dense f16 peak, {SMS[a].name}, "
                                                  f"{which}")


if __name__ == "__main__":
    _main()
