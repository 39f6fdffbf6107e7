"""igemm_simd: the 16-lane int32 / float32 vector values of the integer GEMM (``toolkit/cpu/igemm.py``).

Why explicit vectors: LLVM's vectorisers never turn a plain Numba loop of the shape "int32 lane ``l`` +=
the 4 byte products of output row ``l``" into the wide integer multiply-adds of x86 (measured, LLVM 22:
such loops become ``vpmulld``, or one ``vpmaddwd`` per product with half its lanes zero). Only a
*reduction* loop ``s = int32(s + int32(a[k]) * int32(b[k]))`` over u8 x s8 is rewritten into
``vpdpwssd`` / ``vpmaddwd`` pairs (the X86 partial-reduction pass), and a reduction needs a horizontal
sum per block of 32 (one per activation scale), which costs more than the multiply-adds save. So the
integer GEMM keeps its accumulators in explicit vector values:

  ``IVec``: ``<16 x i32>`` (64 bytes: one zmm, two ymm); ``FVec``: ``<16 x float>``.

Each operation is a Numba ``@intrinsic`` emitting a few lines of LLVM IR; locals of these types are SSA
values, so a kernel written with them is register-blocked as written. Only the dot is ISA-specific,
chosen when the kernel is compiled from the target features Numba compiles for (the host's, or
``NUMBA_CPU_NAME`` + ``NUMBA_CPU_FEATURES``; Numba's disk cache keys entries by them, so an AVX2 build
never loads an AVX-512 one):

  ``dp4(acc, a, b)``: ``acc[l] + sum_{j<4} u8(a.byte[4l+j]) * s8(b.byte[4l+j])`` (exact, wrapping int32)
      +avx512vnni:         ``vpdpbusd zmm``                               (64 multiply-adds / instruction)
      +avxvnni (no 512):   2 x ``{vex} vpdpbusd ymm``
      otherwise:           two i16 multiply-add patterns (even / odd byte of each 16-bit unit, written as
                           ``sext . mul . (even + odd)`` IR, which LLVM's ISel matches): ``vpmaddwd`` +
                           ``vpaddd`` on AVX2 / AVX-512BW (measured: one ``vpdpwssd`` with VNNI).
  ``dp4_small(acc, a, b)``: the same when every ``a`` byte is < 128 (4/3/2-bit codes): without VNNI it is
      ``vpmaddubsw`` (u8 x s8 pairs into i16, exact since 2 * 127 * 128 < 2**15) + ``vpmaddwd`` by ones.

Arrays given to loads / stores must be 1-D and contiguous (row views of C arrays); indices are element
indices, never bounds-checked (the caller proves them). ``isa()`` names the dot the current target gets.
Numba's disk cache checks only a kernel's own file: after editing this module, clear the
``__pycache__`` of ``toolkit/cpu/igemm.py``.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, models, register_model

LANES = 16
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_VI = ir.VectorType(_I32, LANES)  # <16 x i32>
_VF = ir.VectorType(_F32, LANES)  # <16 x float>


class IVecType(types.Type):
    def __init__(self):
        super().__init__(name="igemm.IVec16")


class FVecType(types.Type):
    def __init__(self):
        super().__init__(name="igemm.FVec16")


ivec, fvec = IVecType(), FVecType()


@register_model(IVecType)
class _IVecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


@register_model(FVecType)
class _FVecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


# ---- code generation helpers -------------------------------------------------------------------------------
def _features(context) -> str:
    """The target feature string Numba compiles for ('' when unreadable: generic code)."""
    return getattr(context.codegen(), "_tm_features", "") or ""


def lowering(feats: str) -> str:
    """'avx512vnni', 'avxvnni', 'avx512bw', 'avx2' or 'generic': the dot a feature string gets."""
    f = set(feats.split(","))
    if "+avx512vnni" in f and "+avx512bw" in f:
        return "avx512vnni"
    for name in ("avxvnni", "avx512bw", "avx2"):
        if "+" + name in f:
            return name
    return "generic"


def isa() -> str:
    """The dot lowering of the current Numba target."""
    from numba.core.registry import cpu_target
    return lowering(_features(cpu_target.target_context))


def _splat(builder, value, vty):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


def _elem_ptr(context, builder, aty, arr, idx, ity):
    a = context.make_array(aty)(context, builder, arr)
    return builder.gep(a.data, [context.cast(builder, idx, ity, types.intp)])


def _check_1d(arr, what, itemsize=None, dtype=None):
    if not isinstance(arr, types.Array) or arr.ndim != 1:
        raise TypingError(f"igemm_simd.{what}: needs a 1-D array, got {arr}")
    if dtype is not None and arr.dtype != dtype:
        raise TypingError(f"igemm_simd.{what}: needs a {dtype} array, got {arr}")
    if itemsize is not None and arr.dtype.bitwidth != 8 * itemsize:
        raise TypingError(f"igemm_simd.{what}: needs an array of {itemsize}-byte items, got {arr}")


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _halves(builder, v):
    n = v.type.count // 2
    return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(i, i + n)))) for i in (0, n)]


def _concat(builder, lo, hi):
    n = lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _dp4_generic(builder, acc, a, b):
    """acc + per-lane sum of 4 u8 x s8 products, as two 16-bit multiply-add patterns (portable IR)."""
    v16, v32 = ir.VectorType(_I16, 2 * LANES), ir.VectorType(_I32, 2 * LANES)
    a16, b16 = builder.bitcast(a, v16), builder.bitcast(b, v16)
    eight = ir.Constant(v16, [8] * (2 * LANES))
    a_lo, a_hi = builder.and_(a16, ir.Constant(v16, [255] * (2 * LANES))), builder.lshr(a16, eight)  # u8 -> i16
    b_lo, b_hi = builder.ashr(builder.shl(b16, eight), eight), builder.ashr(b16, eight)  # s8 -> i16
    even = ir.Constant(ir.VectorType(_I32, LANES), list(range(0, 2 * LANES, 2)))
    odd = ir.Constant(ir.VectorType(_I32, LANES), list(range(1, 2 * LANES, 2)))

    def madd(x, y):  # the pmaddwd shape: pairs of i16 products summed into i32
        m = builder.mul(builder.sext(x, v32), builder.sext(y, v32))
        return builder.add(builder.shuffle_vector(m, m, even), builder.shuffle_vector(m, m, odd))

    return builder.add(acc, builder.add(madd(a_lo, b_lo), madd(a_hi, b_hi)))


def _dp4_vnni(builder, acc, a, b, low):
    if low == "avx512vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI, [acc, a, b])
    if low == "avxvnni":
        parts = [_call(builder, "llvm.x86.avx512.vpdpbusd.256", ir.VectorType(_I32, 8), list(p))
                 for p in zip(_halves(builder, acc), _halves(builder, a), _halves(builder, b))]
        return _concat(builder, *parts)
    return None


def _dp4_small(builder, acc, a, b, low):
    """a bytes < 128: u8 x s8 pairs into i16 never saturate, so pmaddubsw + pmaddwd(ones) is exact."""
    if low == "avx512bw":
        v8, v16 = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32)
        p = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", v16, [builder.bitcast(a, v8), builder.bitcast(b, v8)])
        return builder.add(acc, _call(builder, "llvm.x86.avx512.pmaddw.d.512", _VI, [p, ir.Constant(v16, [1] * 32)]))
    if low == "avx2":
        v8, v16 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
        parts = []
        for ah, bh in zip(_halves(builder, a), _halves(builder, b)):
            p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [builder.bitcast(ah, v8), builder.bitcast(bh, v8)])
            parts.append(_call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), [p, ir.Constant(v16, [1] * 16)]))
        return builder.add(acc, _concat(builder, *parts))
    return _dp4_generic(builder, acc, a, b)


# ---- integer vectors ---------------------------------------------------------------------------------------
@intrinsic
def iv_splat(typingctx, x):
    """IVec with int32(x) in every lane."""
    def cg(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.int32), _VI)
    return ivec(x), cg


@intrinsic
def iv_load(typingctx, arr, idx):
    """The 64 bytes at &arr[idx] (arr: 1-D byte array)."""
    _check_1d(arr, "iv_load", itemsize=1)

    def cg(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.load(builder.bitcast(p, _VI.as_pointer()), align=1)
    return ivec(arr, idx), cg


@intrinsic
def iv_bcast4(typingctx, arr, idx):
    """The 4 bytes at &arr[idx] in every lane (arr: 1-D byte array)."""
    _check_1d(arr, "iv_bcast4", itemsize=1)

    def cg(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return _splat(builder, builder.load(builder.bitcast(p, _I32.as_pointer()), align=1), _VI)
    return ivec(arr, idx), cg


@intrinsic
def iv_and(typingctx, v, mask):
    """v & int32(mask), lane-wise."""
    def cg(context, builder, sig, args):
        return builder.and_(args[0], _splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), _VI))
    return ivec(v, mask), cg


@intrinsic
def iv_or(typingctx, a, b):
    def cg(context, builder, sig, args):
        return builder.or_(args[0], args[1])
    return ivec(a, b), cg


@intrinsic
def iv_add(typingctx, a, b):
    """a + b, lane-wise (wrapping int32)."""
    def cg(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return ivec(a, b), cg


@intrinsic
def iv_shr(typingctx, v, n):
    """Logical right shift of every 32-bit lane by n."""
    def cg(context, builder, sig, args):
        return builder.lshr(args[0], _splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), _VI))
    return ivec(v, n), cg


@intrinsic
def iv_shl(typingctx, v, n):
    """Left shift of every 32-bit lane by n."""
    def cg(context, builder, sig, args):
        return builder.shl(args[0], _splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), _VI))
    return ivec(v, n), cg


@intrinsic
def dp4(typingctx, acc, a, b):
    """acc[l] + sum_{j<4} u8(a.byte[4l + j]) * s8(b.byte[4l + j]), exact (int32, wrapping)."""
    def cg(context, builder, sig, args):
        low = lowering(_features(context))
        return _dp4_vnni(builder, *args, low) or _dp4_generic(builder, *args)
    return ivec(acc, a, b), cg


@intrinsic
def dp4_small(typingctx, acc, a, b):
    """``dp4`` when every ``a`` byte is < 128 (4/3/2-bit codes): ``vpmaddubsw`` + ``vpmaddwd`` without VNNI."""
    def cg(context, builder, sig, args):
        low = lowering(_features(context))
        return _dp4_vnni(builder, *args, low) or _dp4_small(builder, *args, low)
    return ivec(acc, a, b), cg


# ---- float vectors -----------------------------------------------------------------------------------------
@intrinsic
def fv_load(typingctx, arr, idx):
    """The 16 float32 at &arr[idx] (arr: 1-D float32 array)."""
    _check_1d(arr, "fv_load", dtype=types.float32)

    def cg(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.load(builder.bitcast(p, _VF.as_pointer()), align=4)
    return fvec(arr, idx), cg


@intrinsic
def fv_load_half(typingctx, arr, idx):
    """The 16 IEEE halves at &arr[idx] (arr: 1-D uint16 array of their bits) as float32, exact (``vcvtph2ps``)."""
    _check_1d(arr, "fv_load_half", dtype=types.uint16)

    def cg(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        h = builder.load(builder.bitcast(p, ir.VectorType(ir.HalfType(), LANES).as_pointer()), align=2)
        return builder.fpext(h, _VF)
    return fvec(arr, idx), cg


@intrinsic
def fv_load_u8(typingctx, arr, idx):
    """The 16 bytes at &arr[idx] (arr: any 1-D array; idx in its items) as float32, exact (``vpmovzxbd`` +
    ``vcvtdq2ps``): q4_K's 6-bit per-block scales and mins (``toolkit/cpu/igemm_pack.py``)."""
    _check_1d(arr, "fv_load_u8")

    def cg(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        b = builder.load(builder.bitcast(p, ir.VectorType(_I8, LANES).as_pointer()), align=1)
        return builder.uitofp(builder.zext(b, _VI), _VF)
    return fvec(arr, idx), cg


@intrinsic
def fv_splat(typingctx, x):
    """FVec with float32(x) in every lane."""
    def cg(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF)
    return fvec(x), cg


@intrinsic
def fv_store(typingctx, arr, idx, v):
    """arr[idx : idx + 16] = v (arr: 1-D float32 array)."""
    _check_1d(arr, "fv_store", dtype=types.float32)

    def cg(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        builder.store(args[2], builder.bitcast(p, _VF.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, idx, v), cg


def _fma(builder, a, b, c):
    return _call(builder, "llvm.fma.v16f32", _VF, [a, b, c])


@intrinsic
def fv_scale_acc(typingctx, f, p, s, x):
    """f + float(p) * (s * x): p IVec (integer dots), s FVec (weight scales), x scalar (activation scale);
    ``vcvtdq2ps``, ``vmulps``, ``vfmadd`` (the last two steps one rounding: fused)."""
    def cg(context, builder, sig, args):
        xs = _splat(builder, context.cast(builder, args[3], sig.args[3], types.float32), _VF)
        return _fma(builder, builder.sitofp(args[1], _VF), builder.fmul(args[2], xs), args[0])
    return fvec(f, p, s, x), cg


@intrinsic
def fv_fma(typingctx, a, b, c):
    """a * b + c, lane-wise, fused."""
    def cg(context, builder, sig, args):
        return _fma(builder, *args)
    return fvec(a, b, c), cg


@intrinsic
def fv_axpy(typingctx, f, v, x):
    """f + v * x (v FVec, x scalar), fused."""
    def cg(context, builder, sig, args):
        xs = _splat(builder, context.cast(builder, args[2], sig.args[2], types.float32), _VF)
        return _fma(builder, args[1], xs, args[0])
    return fvec(f, v, x), cg
