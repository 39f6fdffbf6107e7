"""The decode GEMV with int8 activations (opt-in): integer dot products for the packed int formats.

Spec (the NumPy reference below; the lead may move it to ``toolkit/ref``): each input row is quantized per
group of the weight's group size ``g``: ``s = max|x_group| / 127`` (f32), ``q = clip(rint(x / s), -127, 127)``
(0 where ``s = 0``), ``x_hat = q * s``; the GEMV then computes ``x_hat @ dequant(W).T`` exactly as the f32
GEMV would (the moe_gemm / qlinear references applied to ``x_hat``). Only the decode path (<= 8 rows per
expert) uses it; the prefill path keeps f32 activations.

Kernel: per step of ``W`` code bytes of a weight row (32: ymm, 64: zmm with AVX512-VNNI) the format's byte
decoder yields ``P`` byte planes of unsigned codes; each plane's dot with the matching int8 activation
bytes is one ``byte_dot`` (``vpdpbusd`` with VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on AVX2) into ``W / 4``
int32 lanes (lane ``i`` holds codes of bytes ``4i .. 4i + 3``, never two groups). Per group (or per step
when a step spans ``SPLIT`` groups) the lanes become f32 and are scaled by ``scale_w * scale_x`` (one vector
FMA); the zero points add ``sum_g z_g X_g`` with ``X_g = s_g * sum q`` (exact integer sums). Rows: as the
f32 GEMV (``toolkit/cpu/gemv.py``): 4 weight rows share each activation load for one input row, one row
against up to 4 input rows otherwise.
Formats: int4, int2 (affine), q4_0 (as int4 with zero -8 d), q8_0 (codes + 128 as unsigned bytes, zero
-128 d); others (and K not a multiple of the step) keep f32 activations.
Shapes: ``xq [R, K]`` int8 in the kernel's order, ``sxl [R, K / (4 U)]`` the activation scale of each int32
lane's group (``U`` codes per byte), ``Xh [R, G]`` per-group sums of ``x_hat``; the rest as ``gemv.py``.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from ._jit import Kernel, twin
from .decoders import Decoder, _lead, bind, packed
from .vec import byte_dot, byte_ops, bytes_and, bytes_shr, fma, half, hsum, mul, ops, target_features, to_f32, wide


# ---- NumPy reference (the spec) ----------------------------------------------------------------------
def quantize_act_ref(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """x [R, K] f32 -> q int8 [R, K], s f32 [R, K / g]: symmetric int8 per group of g."""
    xg = np.asarray(x, np.float32).reshape(x.shape[0], -1, g)  # [R, G, g]
    s = (np.abs(xg).max(axis=-1) / np.float32(127)).astype(np.float32)  # [R, G]
    safe = np.where(s == 0, np.float32(1), s)[..., None]
    q = np.clip(np.rint(xg / safe), -127, 127).astype(np.int8)
    return q.reshape(x.shape), s


def dequantize_act_ref(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q int8 [R, K], s [R, G] -> x_hat f32 [R, K]."""
    g = q.shape[1] // s.shape[1]
    return (q.reshape(q.shape[0], -1, g).astype(np.float32) * s[..., None]).reshape(q.shape)


# ---- Numba quantizer (bit-identical to the reference) -----------------------------------------------
@njit(cache=True)
def _quantize_rows(x, g, q, s):  # x [R, K] f32 -> q [R, K] i8, s [R, G] f32
    for r in range(x.shape[0]):
        for gi in range(x.shape[1] // g):
            xr = x[r, gi * g:(gi + 1) * g]
            amax = np.float32(0.0)
            for k in range(g):
                amax = max(amax, abs(xr[k]))
            sc = amax / np.float32(127.0)
            s[r, gi] = sc
            div = sc if sc != 0 else np.float32(1.0)
            qr = q[r, gi * g:(gi + 1) * g]
            for k in range(g):
                qr[k] = np.int8(min(max(np.rint(xr[k] / div), np.float32(-127.0)), np.float32(127.0)))


def quantize_act(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    q = np.empty(x.shape, np.int8)
    s = np.empty((x.shape[0], x.shape[1] // g), np.float32)
    _quantize_rows(np.ascontiguousarray(x, np.float32), g, q, s)
    return q, s


# ---- byte-plane decoders (templates: W and LOADB bound per kernel) ----------------------------------
def _idec_int4(w, e, n, t):  # W bytes -> low nibbles, high nibbles
    b = LOADB(w[0][e, n], t * W)  # noqa: F821
    return bytes_and(b, 15), bytes_shr(b, 4)


def _idec_int2(w, e, n, t):
    b = LOADB(w[0][e, n], t * W)  # noqa: F821
    return bytes_and(b, 3), bytes_and(bytes_shr(b, 2), 3), bytes_and(bytes_shr(b, 4), 3), bytes_shr(b, 6)


def _idec_bytes(w, e, n, t):  # q8_0: codes + 128, stored as unsigned bytes
    return (LOADB(w[0][e, n], t * W),)  # noqa: F821


def _zero_q8(w, e, n, gi):  # (c + 128) d - 128 d
    return np.float32(-128.0) * half(w[1][e, n, gi])


def _zeros_q8(w, e, n, g0):
    return mul(LOAD_HALF(w[1][e, n], g0), SPLAT(np.float32(-128.0)))  # noqa: F821


def _pack_q8_0_u8(qt):
    k = qt.shape[-1]
    blk = np.ascontiguousarray(qt.arrays["blocks"]).reshape(-1, k // 32, 34)
    d = np.ascontiguousarray(blk[..., :2]).view(np.uint16)[..., 0]
    return _lead(qt, blk[..., 2:] ^ np.uint8(0x80), k), _lead(qt, d, k // 32)


def int8_decoder(dec: Decoder):
    """(byte decoder template, planes, the Decoder whose scales / zeros / packing apply) or None."""
    if dec.name in ("affine4", "q4_0"):
        return _idec_int4, 2, dec
    if dec.name == "affine2":
        return _idec_int2, 4, dec
    if dec.name == "q8_0":
        f = dec.funcs
        return _idec_bytes, 1, Decoder("q8_0u8", 1, 1, True, _pack_q8_0_u8, dec.group,
                                       (f[0], f[1], f[2], f[3], f[4], _zero_q8, _zeros_q8, f[7]))
    return None


# ---- kernel templates ----------------------------------------------------------------------------------
def _istep(pl, xq, off, acc):
    for p in range(P):  # noqa: F821
        acc = byte_dot(acc, pl[p], LOADB(xq, off + p * W))  # noqa: F821
    return acc


def _zero_dot(w, e, n, Xm):
    G = Xm.shape[0]
    acc = ZERO()  # noqa: F821
    g0 = 0
    while g0 + NL <= G:  # noqa: F821
        acc = fma(ZEROS(w, e, n, g0), LOAD(Xm, g0), acc)  # noqa: F821
        g0 += NL  # noqa: F821
    t = hsum(acc)
    for gi in range(g0, G):
        t += ZERO_AT(w, e, n, gi) * Xm[gi]  # noqa: F821
    return t


def _wscale(w, e, n, t, spg):  # the weight scale of step t's lanes
    if SPLIT == 1:  # noqa: F821
        return SPLAT(SCALE_AT(w, e, n, t // spg))  # noqa: F821
    return SCALES_REP(w, e, n, t * SPLIT)  # noqa: F821


def _dot4(w, e, na, nb, nc, nd, xq, sx, Xm):
    """Rows na..nd of expert e . one input row: 4 floats."""
    K = xq.shape[0]
    g = K // GROUPS(w)  # noqa: F821
    spg = g // C if SPLIT == 1 else 1  # noqa: F821 (steps per scale epilogue)
    t0, t1, t2, t3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    for t_end in range(spg, K // C + 1, spg):  # noqa: F821
        a0, a1, a2, a3 = IZERO(), IZERO(), IZERO(), IZERO()  # noqa: F821
        for t in range(t_end - spg, t_end):
            off = t * C  # noqa: F821
            a0 = ISTEP(IDEC(w, e, na, t), xq, off, a0)  # noqa: F821
            a1 = ISTEP(IDEC(w, e, nb, t), xq, off, a1)  # noqa: F821
            a2 = ISTEP(IDEC(w, e, nc, t), xq, off, a2)  # noqa: F821
            a3 = ISTEP(IDEC(w, e, nd, t), xq, off, a3)  # noqa: F821
        t = t_end - 1
        sv = LOAD(sx, t * NL)  # noqa: F821
        t0 = fma(to_f32(a0), mul(WSCALE(w, e, na, t, spg), sv), t0)  # noqa: F821
        t1 = fma(to_f32(a1), mul(WSCALE(w, e, nb, t, spg), sv), t1)  # noqa: F821
        t2 = fma(to_f32(a2), mul(WSCALE(w, e, nc, t, spg), sv), t2)  # noqa: F821
        t3 = fma(to_f32(a3), mul(WSCALE(w, e, nd, t, spg), sv), t3)  # noqa: F821
    return (hsum(t0) + ZERO_DOT(w, e, na, Xm), hsum(t1) + ZERO_DOT(w, e, nb, Xm),  # noqa: F821
            hsum(t2) + ZERO_DOT(w, e, nc, Xm), hsum(t3) + ZERO_DOT(w, e, nd, Xm))  # noqa: F821


def _dot_cols(w, e, n, x0, x1, x2, x3, s0, s1, s2, s3):
    """Row n of expert e . 4 input rows: 4 floats before zero terms."""
    K = x0.shape[0]
    g = K // GROUPS(w)  # noqa: F821
    spg = g // C if SPLIT == 1 else 1  # noqa: F821
    t0, t1, t2, t3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    for t_end in range(spg, K // C + 1, spg):  # noqa: F821
        a0, a1, a2, a3 = IZERO(), IZERO(), IZERO(), IZERO()  # noqa: F821
        for t in range(t_end - spg, t_end):
            off = t * C  # noqa: F821
            pl = IDEC(w, e, n, t)  # noqa: F821
            for p in range(P):  # noqa: F821
                v = pl[p]
                a0 = byte_dot(a0, v, LOADB(x0, off + p * W))  # noqa: F821
                a1 = byte_dot(a1, v, LOADB(x1, off + p * W))  # noqa: F821
                a2 = byte_dot(a2, v, LOADB(x2, off + p * W))  # noqa: F821
                a3 = byte_dot(a3, v, LOADB(x3, off + p * W))  # noqa: F821
        t = t_end - 1
        ws = WSCALE(w, e, n, t, spg)  # noqa: F821
        t0 = fma(to_f32(a0), mul(ws, LOAD(s0, t * NL)), t0)  # noqa: F821
        t1 = fma(to_f32(a1), mul(ws, LOAD(s1, t * NL)), t1)  # noqa: F821
        t2 = fma(to_f32(a2), mul(ws, LOAD(s2, t * NL)), t2)  # noqa: F821
        t3 = fma(to_f32(a3), mul(ws, LOAD(s3, t * NL)), t3)  # noqa: F821
    return hsum(t0), hsum(t1), hsum(t2), hsum(t3)


def _gemv(w, xq, sxl, Xh, seg_e, seg_lo, seg_hi, slot, rscale, n_out, n_chunks, out):
    """Template: as gemv.py's, on int8 activations."""
    for it in prange(seg_e.shape[0] * n_chunks):
        WIDE()  # noqa: F821
        sg, c = it // n_chunks, it % n_chunks
        e, lo, hi = seg_e[sg], seg_lo[sg], seg_hi[sg]
        n0 = n_out * c // n_chunks // 4 * 4
        n1 = n_out if c == n_chunks - 1 else n_out * (c + 1) // n_chunks // 4 * 4
        if hi - lo == 1:
            o, rs = out[slot[lo]], rscale[lo]
            for n in range(n0, n1, 4):
                last = n1 - 1
                y = DOT4(w, e, n, min(n + 1, last), min(n + 2, last), min(n + 3, last), xq[lo], sxl[lo], Xh[lo])  # noqa: F821
                for r in range(min(4, n1 - n)):
                    o[n + r] = y[r] * rs
        else:
            for m in range(lo, hi, 4):
                ma, mb, mc, md = m, min(m + 1, hi - 1), min(m + 2, hi - 1), min(m + 3, hi - 1)
                for n in range(n0, n1):
                    y = DOT_COLS(w, e, n, xq[ma], xq[mb], xq[mc], xq[md], sxl[ma], sxl[mb], sxl[mc], sxl[md])  # noqa: F821
                    ms = (ma, mb, mc, md)
                    for r in range(min(4, hi - m)):
                        mr = ms[r]
                        out[slot[mr], n] = (y[r] + ZERO_DOT(w, e, n, Xh[mr])) * rscale[mr]  # noqa: F821


@njit(cache=True)
def _nop():
    pass


def byte_width() -> int:
    """Code bytes per step: 64 (zmm) where the target has AVX512-VNNI, else 32."""
    return 64 if {"avx512vnni", "avx512bw", "avx512vl"} <= target_features() else 32


@functools.cache
def compiled(dec: Decoder, W: int, split: int) -> Kernel:
    idec, P, sdec = int8_decoder(dec)
    NL = W // 4
    f, o, b = bind(sdec, NL, split), ops(NL), byte_ops(W)
    consts = dict(W=W, NL=NL, P=P, C=P * W, SPLIT=split, LOAD=o["load"], LOADB=b["load_bytes"], ZERO=o["zero"],
                  IZERO=b["izero"], SPLAT=o["splat"], WIDE=wide if W == 64 else _nop, GROUPS=f["groups"],
                  SCALE_AT=f["scale_at"], SCALES_REP=f["scales_rep"], ZERO_AT=f["zero_at"], ZEROS=f["zeros"])
    suffix = f"__{sdec.name}_W{W}_s{split}"
    inline = njit(cache=True, inline="always")
    consts["IDEC"] = inline(twin(idec, suffix, **consts))
    for name, fn in (("ISTEP", _istep), ("ZERO_DOT", _zero_dot), ("WSCALE", _wscale)):
        consts[name] = inline(twin(fn, suffix, **consts))
    consts["DOT4"] = inline(twin(_dot4, suffix, **consts))
    consts["DOT_COLS"] = inline(twin(_dot_cols, suffix, **consts))
    return Kernel(twin(_gemv, suffix, **consts), fastmath=True)


class PreparedInt8:
    """A weight made ready for the int8-activation GEMV (None from ``prepare`` when it does not apply)."""

    def __init__(self, dec: Decoder, qt):
        _, P, sdec = int8_decoder(dec)
        self.W = byte_width()
        self.g = dec.group(qt)
        self.K = qt.shape[-1]
        self.arrays = packed(qt, sdec)
        self.C = P * self.W
        lane_codes = 4 * sdec.unit  # codes per int32 lane
        self.lane_rep = self.g // lane_codes  # int32 lanes per group
        self.split = self.C // self.g if self.g < self.C else 1
        self.kernel = compiled(dec, self.W, self.split)
        p = sdec.perm(self.K, self.W)
        self.perm = None if p is None else p


def prepare(dec: Decoder, qt) -> PreparedInt8 | None:
    spec = int8_decoder(dec)
    if spec is None or qt.shape[-1] % (spec[1] * byte_width()):
        return None  # no byte decoder, or K not a whole number of steps: f32 activations
    return packed(qt, dec, key=("int8act", dec.name, byte_width()), pack=lambda q: PreparedInt8(dec, q))


def gemv(wt: PreparedInt8, xg, seg_e, seg_lo, seg_hi, slot, scale, n_out, out, n_chunks):
    """xg [R, K] f32 rows (natural order) -> out rows, with int8 activations."""
    q, s = quantize_act(xg, wt.g)  # [R, K] i8, [R, G] f32
    Xh = (q.reshape(q.shape[0], -1, wt.g).sum(axis=2, dtype=np.int32).astype(np.float32) * s)  # [R, G]
    sxl = np.ascontiguousarray(np.repeat(s, wt.lane_rep, axis=1))  # [R, K / lane codes]
    if wt.perm is not None:
        q = np.ascontiguousarray(q[:, wt.perm])
    work = int((seg_hi - seg_lo).sum()) * n_out * xg.shape[1] // 4
    wt.kernel(work, wt.arrays, q, sxl, np.ascontiguousarray(Xh), seg_e, seg_lo, seg_hi, slot, scale, n_out, n_chunks, out)
