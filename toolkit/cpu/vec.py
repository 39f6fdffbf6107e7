"""Explicit SIMD vectors for the Numba GEMV kernels: LLVM vector types and the few operations they need.

Why: LLVM's loop vectoriser, fed plain Numba loops, gave the quantized GEMV a horizontal reduction per
group, register spills with several rows in flight, int64 lanes for byte arithmetic and gathers wherever an
index was computed (measured). Written with these values instead, a kernel's inner loop is exactly the
instructions it names: a code load with zero/sign extension, shifts and masks, one conversion and one FMA
per lane group. The IR is target-neutral LLVM vector IR, so the same kernel compiles to AVX2 (ymm) or
AVX-512 (zmm) for whatever CPU Numba targets (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``).

Values: ``F32[L]`` (``<L x float>``), ``I32[L]`` (``<L x i32>``) for L in (8, 16). ``ops(L)`` returns the width-bound constructors and loads (bound into a
kernel as globals, like the format decoders); the arithmetic below is polymorphic over the width.
Loads take a C-contiguous 1-D array and an element offset and never check bounds: a kernel proves its
offsets (shapes asserted by its launcher).
``wide()`` marks the calling kernel's LLVM function so that 512-bit vectors stay in zmm registers (LLVM
otherwise splits them on CPUs where it prefers 256-bit vectors, every AVX-512 Xeon); a no-op elsewhere.
(The int8-activation kernels have their own vectors: ``toolkit/cpu/igemm_simd.py``.)
"""
from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils, errors
from numba.extending import intrinsic, models, register_model

FAST = ("fast",)  # fast-math flags on vector float ops: lets LLVM fuse mul + add into FMA
_I32 = ir.IntType(32)


class Vec(types.Type):
    """A SIMD value: ``elem`` in ('f32', 'i32') with ``lanes`` lanes."""

    def __init__(self, elem: str, lanes: int):
        self.elem, self.lanes = elem, lanes
        super().__init__(f"{elem}x{lanes}")

    @property
    def key(self):
        return self.elem, self.lanes


_IR_ELEM = {"f32": ir.FloatType(), "i32": ir.IntType(32)}


def llvm_type(t: Vec) -> ir.VectorType:
    return ir.VectorType(_IR_ELEM[t.elem], t.lanes)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, llvm_type(fe_type))


@functools.cache
def F32(lanes):
    return Vec("f32", lanes)


@functools.cache
def I32(lanes):
    return Vec("i32", lanes)


# ---- helpers for the code generators -------------------------------------------------------------
def _features(context) -> set:
    """The target's ISA features as Numba compiles for them (host, or NUMBA_CPU_FEATURES)."""
    feats = getattr(context.codegen(), "_tm_features", "") or ""
    return {f[1:] for f in feats.split(",") if f.startswith("+")}


def target_features() -> set:
    """The ISA features Numba compiles the CPU kernels for (the host's, or ``NUMBA_CPU_FEATURES``)."""
    from numba.core.registry import cpu_target

    return _features(cpu_target.target_context)


def max_lanes() -> int:
    """f32 lanes of the widest vectors worth using on the target: 16 with AVX-512 (zmm), else 8 (ymm)."""
    return 16 if {"avx512f", "avx512bw", "avx512vl"} <= target_features() else 8


def _ptr(context, builder, aty, a, ity, idx, vty):
    """Pointer to element ``idx`` of the C-contiguous 1-D array ``a``, cast to ``vty*``."""
    data = context.make_array(aty)(context, builder, a).data
    i = context.cast(builder, idx, ity, types.intp)
    return builder.bitcast(builder.gep(data, [i]), vty.as_pointer())


def _check_array(a, dtypes, what):
    if not isinstance(a, types.Array) or a.ndim != 1 or a.layout != "C" or str(a.dtype) not in dtypes:
        raise errors.TypingError(f"{what}: need a C-contiguous 1-D {'/'.join(dtypes)} array, got {a}")


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, vty.count),
                                                                                  [0] * vty.count))


def _int_arg(context, builder, v, vty_from, lanes):
    """A scalar integer argument as an i32 vector splat."""
    return _splat(builder, context.cast(builder, v, vty_from, types.int32), ir.VectorType(_I32, lanes))


# ---- width-bound constructors and loads ----------------------------------------------------------
@functools.cache
def ops(L: int):
    """The constructors and loads of width ``L`` (8: ymm, 16: zmm on AVX-512 / two ymm on AVX2)."""
    fv, iv = F32(L), I32(L)
    vf, vi = llvm_type(fv), llvm_type(iv)

    @intrinsic
    def zero(typingctx):
        return fv(), lambda context, builder, sig, args: ir.Constant(vf, [0.0] * L)

    @intrinsic
    def splat(typingctx, s):
        def cg(context, builder, sig, args):
            return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), vf)
        return fv(s), cg

    @intrinsic
    def iota(typingctx):  # i32 [0, 1, ..., L-1]
        return iv(), lambda context, builder, sig, args: ir.Constant(vi, list(range(L)))

    @intrinsic
    def load(typingctx, a, i):
        """a[i : i + L] as F32 (float32 array), I32 zero- (uint8) or sign-extended (int8) codes."""
        _check_array(a, ("float32", "uint8", "int8"), "simd load")
        kind = str(a.dtype)

        def cg(context, builder, sig, args):
            if kind == "float32":
                return builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], vf), align=4)
            raw = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                    ir.VectorType(ir.IntType(8), L)), align=1)
            return builder.zext(raw, vi) if kind == "uint8" else builder.sext(raw, vi)
        return (fv if kind == "float32" else iv)(a, i), cg

    @intrinsic
    def load_half(typingctx, a, i):
        """a[i : i + L] of a uint16 array holding IEEE half bits, as F32 (exact; ``vcvtph2ps``)."""
        _check_array(a, ("uint16",), "simd load_half")

        def cg(context, builder, sig, args):
            raw = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                    ir.VectorType(ir.IntType(16), L)), align=2)
            return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), L)), vf)
        return fv(a, i), cg

    @intrinsic
    def load_e4m3(typingctx, a, i):
        """a[i : i + L] of a uint8 array of float8 e4m3fn codes, as F32 values / 256 (exact): the code's
        sign, exponent and mantissa moved into a half (``(sext(c) << 7) & 0xBF80``) and widened by
        ``vcvtph2ps``; e4m3 and half differ in exponent bias by 8, so the caller multiplies by 2**8 (folded
        into the row scale). NaN codes (0x7F / 0xFF; the encoder never writes them) decode to +-480 / 256."""
        _check_array(a, ("uint8",), "simd load_e4m3")

        def cg(context, builder, sig, args):
            i16v = ir.VectorType(ir.IntType(16), L)
            raw = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                    ir.VectorType(ir.IntType(8), L)), align=1)
            h = builder.and_(builder.shl(builder.sext(raw, i16v), ir.Constant(i16v, [7] * L)),
                             ir.Constant(i16v, [0xBF80] * L))
            return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), L)), vf)
        return fv(a, i), cg

    @intrinsic
    def load_bf16(typingctx, a, i):
        """a[i : i + L] of a uint16 array holding bfloat16 bits, as F32 (exact: the bits shifted up by 16)."""
        _check_array(a, ("uint16",), "simd load_bf16")

        def cg(context, builder, sig, args):
            raw = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                    ir.VectorType(ir.IntType(16), L)), align=2)
            return builder.bitcast(builder.shl(builder.zext(raw, vi), ir.Constant(vi, [16] * L)), vf)
        return fv(a, i), cg

    @intrinsic
    def store(typingctx, a, i, v):
        """a[i : i + L] = v (float32 array, F32 value)."""
        _check_array(a, ("float32",), "simd store")
        if v != fv:
            raise errors.TypingError(f"simd store: need {fv}, got {v}")

        def cg(context, builder, sig, args):
            builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], vf), align=4)
            return context.get_dummy_value()
        return types.none(a, i, v), cg

    @intrinsic
    def load_u24(typingctx, a, i):
        """The L 3-byte units starting at byte i of a uint8 array, each zero-extended into an i32 lane
        (``b0 | b1 << 8 | b2 << 16``): one 3L-byte load and one byte shuffle (vpermb / vpshufb)."""
        _check_array(a, ("uint8",), "simd load_u24")

        def cg(context, builder, sig, args):
            raw = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                    ir.VectorType(ir.IntType(8), 3 * L)), align=1)
            zeros = ir.Constant(ir.VectorType(ir.IntType(8), 3 * L), [0] * (3 * L))
            mask = [3 * L if j % 4 == 3 else 3 * (j // 4) + j % 4 for j in range(4 * L)]  # index 3L: a zero byte
            lanes = builder.shuffle_vector(raw, zeros, ir.Constant(ir.VectorType(_I32, 4 * L), mask))
            return builder.bitcast(lanes, vi)
        return iv(a, i), cg

    @intrinsic
    def load_half_rep(typingctx, a, i, n):
        """The n (a constant dividing L) halves a[i : i + n] as F32, each repeated in L / n consecutive lanes
        (per-lane scales when one vector spans n quantization groups)."""
        _check_array(a, ("uint16",), "simd load_half_rep")
        if not isinstance(n, types.IntegerLiteral) or L % n.literal_value:
            raise errors.TypingError(f"simd load_half_rep: n must be a constant dividing {L}, got {n}")
        k = n.literal_value

        def cg(context, builder, sig, args):
            raw = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                    ir.VectorType(ir.IntType(16), k)), align=2)
            rep = builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, L), [j * k // L for j in range(L)]))
            return builder.fpext(builder.bitcast(rep, ir.VectorType(ir.HalfType(), L)), vf)
        return fv(a, i, n), cg

    @intrinsic
    def load_rep(typingctx, a, i, n):
        """The n (a constant dividing L) bytes a[i : i + n] of an int8 / uint8 array as I32 (sign- / zero-extended),
        each repeated in L / n consecutive lanes (per-lane scale factors of the k-quants)."""
        _check_array(a, ("uint8", "int8"), "simd load_rep")
        if not isinstance(n, types.IntegerLiteral) or L % n.literal_value:
            raise errors.TypingError(f"simd load_rep: n must be a constant dividing {L}, got {n}")
        k, signed = n.literal_value, str(a.dtype) == "int8"

        def cg(context, builder, sig, args):
            raw = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                    ir.VectorType(ir.IntType(8), k)), align=1)
            rep = builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, L), [j * k // L for j in range(L)]))
            return builder.sext(rep, vi) if signed else builder.zext(rep, vi)
        return iv(a, i, n), cg

    return dict(zero=zero, splat=splat, iota=iota, load=load, load_half=load_half, load_e4m3=load_e4m3,
                load_bf16=load_bf16, store=store, load_u24=load_u24, load_half_rep=load_half_rep, load_rep=load_rep)


# ---- arithmetic (any width) ----------------------------------------------------------------------
def _same_vec(*vs):
    return all(isinstance(v, Vec) for v in vs) and len({v.key for v in vs}) == 1


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c (F32); one vfmadd on FMA targets."""
    if not (_same_vec(a, b, c) and a.elem == "f32"):
        return None

    def cg(context, builder, sig, args):
        return builder.fadd(builder.fmul(args[0], args[1], flags=FAST), args[2], flags=FAST)
    return a(a, b, c), cg


def _binary(op_f, op_i):
    @intrinsic
    def f(typingctx, a, b):
        if not _same_vec(a, b) or (a.elem == "f32" and op_f is None) or (a.elem != "f32" and op_i is None):
            return None

        def cg(context, builder, sig, args):
            if a.elem == "f32":
                return getattr(builder, op_f)(args[0], args[1], flags=FAST)
            return getattr(builder, op_i)(args[0], args[1])
        return a(a, b), cg
    return f


add = _binary("fadd", "add")
mul = _binary("fmul", "mul")
sub = _binary("fsub", "sub")
bor = _binary(None, "or_")


def _shift(op):
    @intrinsic
    def f(typingctx, v, n):
        """Each i32 lane shifted by the scalar ``n`` (``shr``: logical), or by the lanes of an I32 ``n``."""
        if not (isinstance(v, Vec) and v.elem == "i32" and (isinstance(n, types.Integer) or _same_vec(v, n))):
            return None

        def cg(context, builder, sig, args):
            amount = args[1] if isinstance(sig.args[1], Vec) else _int_arg(context, builder, args[1], sig.args[1],
                                                                          v.lanes)
            return getattr(builder, op)(args[0], amount)
        return v(v, n), cg
    return f


shl, shr = _shift("shl"), _shift("lshr")


@intrinsic
def band(typingctx, v, m):
    """Each i32 lane AND the scalar ``m``."""
    if not (isinstance(v, Vec) and v.elem == "i32" and isinstance(m, types.Integer)):
        return None

    def cg(context, builder, sig, args):
        return builder.and_(args[0], _int_arg(context, builder, args[1], sig.args[1], v.lanes))
    return v(v, m), cg


@intrinsic
def to_f32(typingctx, v):
    """I32 -> F32 (``vcvtdq2ps``), exact for |v| < 2**24."""
    if not (isinstance(v, Vec) and v.elem == "i32"):
        return None
    return F32(v.lanes)(v), lambda context, builder, sig, args: builder.sitofp(args[0], llvm_type(F32(v.lanes)))


@intrinsic
def e2m1(typingctx, v):
    """I32 lanes holding e2m1 codes (0..15: sign, 2-bit exponent, 1-bit mantissa) -> F32 value * 2**-14, exact:
    the code's bits moved into a half (``(c & 7) << 9 | (c & 8) << 12``: e2m1 and half differ in exponent bias
    by 14, subnormal 0.5 included) and widened by ``vcvtph2ps``; the caller folds 2**14 into the scale."""
    if not (isinstance(v, Vec) and v.elem == "i32"):
        return None
    L = v.lanes

    def cg(context, builder, sig, args):
        i16v = ir.VectorType(ir.IntType(16), L)
        c = builder.trunc(args[0], i16v)
        mag = builder.shl(builder.and_(c, ir.Constant(i16v, [7] * L)), ir.Constant(i16v, [9] * L))
        sign = builder.shl(builder.and_(c, ir.Constant(i16v, [8] * L)), ir.Constant(i16v, [12] * L))
        h = builder.or_(mag, sign)
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), L)), llvm_type(F32(L)))
    return F32(L)(v), cg


@intrinsic
def hsum(typingctx, v):
    """The sum of an F32's lanes (halving tree: log2(L) shuffles and adds)."""
    if not (isinstance(v, Vec) and v.elem == "f32"):
        return None

    def cg(context, builder, sig, args):
        x, n = args[0], v.lanes
        while n > 1:
            n //= 2
            mask = lambda lo: ir.Constant(ir.VectorType(_I32, n), list(range(lo, lo + n)))  # noqa: E731
            x = builder.fadd(builder.shuffle_vector(x, x, mask(0)), builder.shuffle_vector(x, x, mask(n)), flags=FAST)
        return builder.extract_element(x, ir.Constant(_I32, 0))
    return types.float32(v), cg


@intrinsic
def half(typingctx, h):
    """One IEEE half (its uint16 bits) -> float32, exact (``vcvtph2ps``)."""
    if not isinstance(h, types.Integer):
        return None

    def cg(context, builder, sig, args):
        bits = context.cast(builder, args[0], sig.args[0], types.uint16)
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
    return types.float32(h), cg


@intrinsic
def f32_bits(typingctx, b):
    """The float32 whose bits are the low 32 bits of the integer ``b`` (a bit cast)."""
    if not isinstance(b, types.Integer):
        return None

    def cg(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), ir.FloatType())
    return types.float32(b), cg


@intrinsic
def wide(typingctx):
    """Let the calling kernel keep 512-bit vectors in zmm registers (see the module docstring)."""
    def cg(context, builder, sig, args):
        attrs = builder.function.attributes
        for a in ('"min-legal-vector-width"="512"', '"prefer-vector-width"="512"'):
            set.add(attrs, a)  # llvmlite knows no string attributes; the set prints them verbatim
        return context.get_dummy_value()
    return types.none(), cg


@intrinsic
def prefetch(typingctx, a, i):
    """Prefetch the cache line holding ``a[i]`` (1-D C-contiguous array) into L1 for reading; no bounds check
    is needed (a prefetch never faults)."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and isinstance(i, types.Integer)):
        return None

    def cg(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], ir.IntType(8))
        fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(p, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(a, i), cg
