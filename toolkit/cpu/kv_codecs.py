"""Per-format row codecs for the KV cache kernels: a traits table (``ROW_CODECS``), looked up once by format;
the kernels are compiled per format with its codecs bound in (``toolkit/cpu/_jit.twin``).

Each cache format has two Numba functions over the rows of one (sequence, KV head) (a row: the head-dim
vector of one token): ``store(x [hd] f32, out_row)`` (quantize on write) and
``block(rows [S, row], j0, n, buf [KEYS, hd] f32) -> (tile, o)``: the rows ``j0 .. j0 + n`` as f32 rows
``tile[o : o + n]``, scales applied. An f32 cache returns its own rows (nothing is copied, no view made); a
quantized one decodes into ``buf``, a tile that lives in L1 and serves every query row of the attention block, then is overwritten by the
next block: the cache itself is never dequantized to a temporary.

The GGML decoders are written in LLVM vector IR (``@intrinsic``): 16 codes per vector (sign-extend, convert,
scale), the f16 scale converted by the hardware. Plain Numba loops of 16 or 32 codes stay scalar here: LLVM
unrolls a constant trip count first and then cannot prove that the tile and the cache do not overlap. The small
IR helpers (``view``, ``load``, ``store``, ``splat``, ``LANES``) are shared with :mod:`toolkit.cpu.kv_attention`.
"""
from __future__ import annotations

import llvmlite.binding as ll
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from ..formats.ggml import QK, q4_0_quantize_block, q8_0_quantize_block

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
# vector width of the attention products: 16 f32 lanes where the compile target has AVX-512, else 8 (AVX2)
_FEATURES = config.CPU_FEATURES if config.CPU_FEATURES is not None else ll.get_host_cpu_features().flatten()
LANES = int(__import__("os").environ.get("KVL", 0)) or (16 if "+avx512f" in _FEATURES.split(",") else 8)


def vec(n: int, t=F32) -> ir.VectorType:
    return ir.VectorType(t, n)


def view(context, b, ty, val):
    """An array argument -> (data pointer, shape values, strides in elements)."""
    a = context.make_array(ty)(context, b, val)
    size = context.get_abi_sizeof(context.get_data_type(ty.dtype))
    return (a.data, cgutils.unpack_tuple(b, a.shape),
            [b.sdiv(x, I64(size)) for x in cgutils.unpack_tuple(b, a.strides)])


def load(b, base, off, t):
    """Unaligned vector (or scalar) of type ``t`` at element ``off`` of ``base``."""
    return b.load(b.bitcast(b.gep(base, [off]), t.as_pointer()), align=1)


def store(b, v, base, off):
    b.store(v, b.bitcast(b.gep(base, [off]), v.type.as_pointer()), align=1)


def splat(b, x, n: int):
    x = b.insert_element(ir.Constant(vec(n, x.type), ir.Undefined), x, I32(0))
    return b.shuffle_vector(x, x, ir.Constant(vec(n, I32), [0] * n))


def _is(t, dtype, ndim) -> bool:
    return isinstance(t, types.Array) and t.dtype == dtype and t.ndim == ndim and t.layout == "C"


def _decoder(block_bytes: int, codes):
    """An intrinsic ``decode(rows [S, row] u8, j0, n, buf [KEYS, hd] f32)``: ``buf[j] = rows[j0 + j]`` decoded for
    ``j < n``, each 32-value block ``d * codes``; ``codes(b, src)`` gives the two halves (16 values each) of the
    block whose codes start at ``src`` as ``<16 x i32>``."""
    @intrinsic
    def decode(typingctx, rows, j0, n, buf):
        def codegen(context, b, sig, args):
            rp, _, (rs, _) = view(context, b, sig.args[0], args[0])
            bp, (_, hd), (bs, _) = view(context, b, sig.args[3], args[3])
            j0, n = (context.cast(b, args[i], sig.args[i], types.int64) for i in (1, 2))
            with cgutils.for_range(b, n) as j:
                src = b.gep(rp, [b.mul(b.add(j0, j.index), rs)])
                dst = b.gep(bp, [b.mul(j.index, bs)])
                with cgutils.for_range(b, b.sdiv(hd, I64(QK))) as g:
                    blk = b.gep(src, [b.mul(g.index, I64(block_bytes))])
                    d = splat(b, b.fpext(b.bitcast(load(b, blk, I64(0), ir.IntType(16)), ir.HalfType()), F32), 16)
                    for h, half in enumerate(codes(b, b.gep(blk, [I64(2)]))):
                        store(b, b.fmul(b.sitofp(half, vec(16)), d), dst, b.add(b.mul(g.index, I64(QK)), I64(16 * h)))
            return context.get_dummy_value()

        if _is(rows, types.uint8, 2) and _is(buf, types.float32, 2) and all(isinstance(t, types.Integer) for t in (j0, n)):
            return types.void(rows, j0, n, buf), codegen
        return None

    return decode


def _q8_0_codes(b, src):  # 32 int8 codes
    return [b.sext(load(b, src, I64(16 * h), vec(16, ir.IntType(8))), vec(16, I32)) for h in range(2)]


def _q4_0_codes(b, src):  # 16 bytes: value i in the low nibble of byte i, value i + 16 in its high nibble; minus 8
    x = load(b, src, I64(0), vec(16, ir.IntType(8)))
    c = lambda v: ir.Constant(vec(16, ir.IntType(8)), [v] * 16)  # noqa: E731
    return [b.sext(b.sub(h, c(8)), vec(16, I32)) for h in (b.and_(x, c(15)), b.lshr(x, c(4)))]


_decode_q8_0 = _decoder(34, _q8_0_codes)
_decode_q4_0 = _decoder(18, _q4_0_codes)


# ---- the row codecs of each cache format (bound into the kernels per format: no run-time branch) ---------
@njit(cache=True, inline="always")
def f32_store(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i]


@njit(cache=True, inline="always")
def f32_block(rows, j0, n, buf):  # the stored rows already are the tile
    return rows, j0


@njit(cache=True, inline="always")
def q8_0_store(x, out):
    for b in range(x.shape[0] // QK):
        q8_0_quantize_block(x[b * QK : (b + 1) * QK], out[b * 34 : (b + 1) * 34])


@njit(cache=True, inline="always")
def q4_0_store(x, out):
    for b in range(x.shape[0] // QK):
        q4_0_quantize_block(x[b * QK : (b + 1) * QK], out[b * 18 : (b + 1) * 18])


@njit(cache=True, inline="always")
def q8_0_block(rows, j0, n, buf):
    _decode_q8_0(rows, j0, n, buf)
    return buf, 0


@njit(cache=True, inline="always")
def q4_0_block(rows, j0, n, buf):
    _decode_q4_0(rows, j0, n, buf)
    return buf, 0


# Cache format name -> (store, block): the one table that maps cache formats to their row codecs.
ROW_CODECS = {"f32": (f32_store, f32_block), "q8_0": (q8_0_store, q8_0_block), "q4_0": (q4_0_store, q4_0_block)}
