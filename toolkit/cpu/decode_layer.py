"""decode_layer (Numba): one GQA MoE decoder layer at one token, in one compiled call.

The staged path (``DecoderLayer`` in ``toolkit/model/model.py``: each stage an op called from Python) stays
the specification; this runs the same stages with the same kernels (their serial builds) from one Numba
function, so a decode step costs one Python call per layer instead of about thirty:

    x = rms_norm(h, attn_norm)                     [1, D]
    q | k | v = x @ Wqkv.T + b                     [1, H*hd | Hkv*hd | Hkv*hd]   (gemv_f32)
    q, k = q/k RMSNorm (per head or projection), clip, rope      (what the architecture has)
    q, k = q @ R, k @ R                                          (a rotated key cache: R = hadamard(hd); kv_rotate)
    kv_store(k, v) at pos;  att = kv_attention(q)                (the cache's row codecs bound in)
    h += att @ Wo.T + b
    x = rms_norm(h, ffn_norm);  logits = x @ Wr.T  [1, E];  (w, ids) = topk_softmax(logits)   [1, A]
    y = sum_a w_a * down_a(silu_and_mul(gate_up_a(x)))  (the experts' format GEMV, one segment per expert)
    y += shared_down(silu_and_mul(shared_gate_up(x))) (* sigmoid(x . shared_gate))
    h += y

``h [1, D]`` is updated in place. Dense f32 products go through ``gemv_f32`` (``toolkit/cpu/gemv_f32.py``), which
the staged path also calls at one token; attention's projections held 16-bit (``Runtime.dense``) through the
GEMV qlinear runs for them (``dense_arg``: the plain 16-bit GEMV for a small weight, else the format's
template); quantized experts through their format's GEMV template
(``toolkit/cpu/gemv.py``, packed arrays of the format's decoder), with the staged path's group sums; the
shared expert's gate through ``gate_den``. So the two paths give the same bits, and every product here is a
kernel the tests already hold against the NumPy references. One build per (K cache, V cache, expert
gate_up decoder, expert down decoder, attention's f32 / 16-bit projections), compiled when ``toolkit/model/decode_step.py`` allows it and cached
on disk under its own name.
Which layers run here and when: ``toolkit/model/decode_step.py``.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ._jit import twin
from .gated_add import gate_den
from .gemv_f32 import gemv_bf16, gemv_f16, gemv_f32, gemv_f32_parallel
from .igemm import StepWeight, _quantize, act_terms
from .kv_attention import kernel_for as attention_kernel
from .kv_rotate import kv_rotate
from .moe_gemm import _group_sums as group_sums, kernel_for
from .qlinear import one_row_16
from .kv_store import kernel_for as store_kernel
from .rms_norm import _rms_norm
from .rope import _rope
from .silu_and_mul import _silu_and_mul
from .topk_softmax import _topk_softmax

RMS_NORM, ROPE, SILU_AND_MUL, TOPK_SOFTMAX = _rms_norm.serial, _rope.serial, _silu_and_mul.serial, _topk_softmax.serial
quantize_rows = _quantize.serial


def _linear(w, x, perm, G, seg_e, seg_lo, seg_hi, slot, rscale, out):
    """Template (GEMV, HAS_ZERO bound per decoder): rows ``x [R, K]`` (natural order) through the
    segments' experts of packed weight ``w`` -> ``out [R, N]`` (row r scaled by rscale[r])."""
    R, K = x.shape
    X = group_sums(x, G) if HAS_ZERO else np.zeros((R, 1), np.float32)  # noqa: F821 (the zero-point term's sums)
    if perm.shape[0] == K:  # the order the kernel reads a row in (a one-element placeholder: natural order)
        xp = np.empty((R, K), np.float32)
        for r in range(R):
            for i in range(K):
                xp[r, i] = x[r, perm[i]]
    else:
        xp = x
    # N in CHUNKS chunks (the parallel build's 16; the serial build's 1): a dense projection is one segment, and with
    # one chunk its whole GEMV ran on one thread (Mixtral's 16-bit q/k/v/o did not speed up on a 2nd core). The
    # rows' sums do not depend on the chunks: the same bits. int64, as the staged path passes it (one build).
    GEMV(w, xp, X, seg_e, seg_lo, seg_hi, slot, rscale, out.shape[1], np.int64(CHUNKS), out)  # noqa: F821


def _linear_int8(w, x, perm, G, seg_e, seg_lo, seg_hi, slot, rscale, out):
    """Template (IGEMV bound: ``toolkit/cpu/igemm.py``'s one-row kernel of the weight's code width), the same
    call as ``_linear``: rows ``x [R, K]`` quantized to 8-bit blocks (``QUANTIZE``, the staged path's
    ``quantize_act``), then the integer GEMV; ``w`` = ``StepWeight.arrays`` (perm and G unused)."""
    codes, S, Z, sgrp, params = w
    R, K = x.shape
    B = K // 32
    q = np.zeros((R + 1, K), np.int8)
    sx = np.zeros((R + 1, B), np.float32)
    sums = np.zeros((R + 1, B), np.int32)
    QUANTIZE(x, q, sx, sums)  # noqa: F821
    bpz = params[1]
    seed, A = act_terms(sx, sums, params[0], bpz)  # the staged path's own terms
    IGEMV(codes, S, Z, sgrp, bpz, q, sx, seed.view(np.uint8), A, np.arange(R), slot, rscale, seg_e, seg_lo, seg_hi,  # noqa: F821
          out)


def _experts_packed(gu, gu_perm, gu_G, dn, dn_perm, dn_G, x, ids, wts, out):
    """Template (GATE_UP, DOWN: ``_linear`` builds): ``out [D] = sum_a wts[a] down_a(silu_and_mul(gate_up_a(x)))``
    over the A experts ``ids``, one GEMV segment per expert."""
    A, D = ids.shape[0], x.shape[0]
    seg_e, rows = np.empty(A, np.int64), np.arange(A)
    xa = np.empty((A, D), np.float32)
    for a in range(A):  # element loops, no slice assignment: that would compile Numba's shape-mismatch message
        seg_e[a] = ids[a]  # (string formatting: about 1 s of a cold compile)
        for d in range(D):
            xa[a, d] = x[d]
    N1 = GU_ROWS(gu)  # noqa: F821 (the packing's output rows: its layout's, bound per build)
    g = np.empty((A, N1), np.float32)
    GATE_UP(gu, xa, gu_perm, gu_G, seg_e, rows, rows + 1, rows, np.ones(A, np.float32), g)  # noqa: F821
    act = np.empty((A, N1 // 2), np.float32)
    SILU_AND_MUL(g, act)
    ye = np.empty((A, D), np.float32)
    DOWN(dn, act, dn_perm, dn_G, seg_e, rows, rows + 1, rows, wts, ye)  # noqa: F821
    for d in range(D):
        out[d] = ye[0, d]
    for a in range(1, A):
        for d in range(D):
            out[d] += ye[a, d]


def _experts_f32(gu, gu_perm, gu_G, dn, dn_perm, dn_G, x, ids, wts, out):
    """Template, dense f32 experts (``gu [E, 2I, D]``, ``dn [E, D, I]`` as 1-tuples): the same sum."""
    A, D = ids.shape[0], x.shape[0]
    N1 = gu[0].shape[1]
    g, act, y = np.empty((1, N1), np.float32), np.empty((1, N1 // 2), np.float32), np.empty(D, np.float32)
    for a in range(A):
        gemv_f32(gu[0][ids[a]], x, g[0])
        SILU_AND_MUL(g, act)
        gemv_f32(dn[0][ids[a]], act[0], y)
        for d in range(D):
            out[d] = wts[a] * y[d] if a == 0 else out[d] + wts[a] * y[d]


def _dense_packed(w, x, out):
    """Template (LINEAR: the ``_linear`` build of a 16-bit format): ``out [N] = W [N, K] . x [K]`` for a dense
    16-bit weight packed as one expert, ``w`` = (packed arrays, x order, scale groups): qlinear's GEMV at one token."""
    arrays, perm, G = w
    zero, one = np.zeros(1, np.int64), np.ones(1, np.int64)
    LINEAR(arrays, x.reshape((1, x.shape[0])), perm, G, zero, zero, one, zero, np.ones(1, np.float32),  # noqa: F821
           out.reshape((1, out.shape[0])))


@njit(cache=True, inline="always")
def _rows_gemv(w):  # output rows of a GEMV packing: its first array is [E, N, ...]
    return w[0].shape[1]


@njit(cache=True, inline="always")
def _rows_int8(w):  # output rows of a StepWeight: params [offset, bpz, N]
    return w[4][2]


@njit(cache=True)
def _rows(src, lo, n, width):
    """``src[lo : lo + n]`` (1-D) as a new ``[n / width, width]`` array (a copy: no reshape in the kernel)."""
    out = np.empty((n // width, width), np.float32)
    for i in range(n):
        out[i // width, i % width] = src[lo + i]
    return out


def _decode_layer(h, pos, eps, attn_norm, ffn_norm, qkv, qkv_b, o, o_b, q_norm, k_norm, clip, inv_freq,
                  rope_scale, k_store, v_store, rot, attn_scale, window, sinks, router, top_k, renorm,
                  gu, gu_perm, gu_G, dn, dn_perm, dn_G, sh_gu, sh_dn, sh_gate, heads):
    """Template (the cache codecs and the experts' part bound per build); see the module docstring.
    ``heads`` = (H, Hkv, hd); dense weights ``[N, K]`` f32, ``qkv`` and ``o`` as ``QKV_GEMV`` / ``O_GEMV`` read
    them (``dense_arg``); ``sh_*`` with zero rows: no shared expert / no
    shared gate; ``q_norm`` of zero length: no q/k norm; ``clip <= 0``: no clip; ``rot [hd, hd]`` the cache's
    key rotation, zero rows: none."""
    H, Hkv, hd = heads
    D = h.shape[1]
    nq, nk = H * hd, Hkv * hd
    positions = np.full((1, 1), pos, np.int64)

    # ---- attention ----
    x = np.empty((1, D), np.float32)
    RMS_NORM(h, attn_norm, eps, x)
    y = np.empty(nq + 2 * nk, np.float32)
    QKV_GEMV(qkv, x[0], y)  # noqa: F821
    for i in range(nq + 2 * nk):
        y[i] += qkv_b[i]
    if clip > 0:
        for i in range(nq + 2 * nk):
            y[i] = min(max(y[i], -clip), clip) if q_norm.shape[0] == 0 or i >= nq + nk else y[i]
    wq = q_norm.shape[0] if q_norm.shape[0] > 0 else hd
    q, k = _rows(y, 0, nq, wq), _rows(y, nq, nk, k_norm.shape[0] if k_norm.shape[0] > 0 else hd)
    if q_norm.shape[0] > 0:  # per head ([hd]) or over the projection ([H*hd]); clip after the norm
        RMS_NORM(q, q_norm, eps, q)
        RMS_NORM(k, k_norm, eps, k)
        if clip > 0:
            for t in (q, k):
                for r in range(t.shape[0]):
                    for i in range(t.shape[1]):
                        t[r, i] = min(max(t[r, i], -clip), clip)
    q4, k4 = np.empty((1, 1, H, hd), np.float32), np.empty((1, 1, Hkv, hd), np.float32)
    v4 = np.empty((1, 1, Hkv, hd), np.float32)
    for i in range(nq):
        q4[0, 0, i // hd, i % hd] = q[i // q.shape[1], i % q.shape[1]]
    for i in range(nk):
        k4[0, 0, i // hd, i % hd] = k[i // k.shape[1], i % k.shape[1]]
        v4[0, 0, i // hd, i % hd] = y[nq + nk + i]
    qr, kr = np.empty((1, 1, H, hd), np.float32), np.empty((1, 1, Hkv, hd), np.float32)
    ROPE(q4, positions, inv_freq, rope_scale, qr)
    ROPE(k4, positions, inv_freq, rope_scale, kr)
    if rot.shape[0] > 0:  # a rotated key cache: keys stored and queries read rotated (KVCache's kv_rotate)
        qs, ks = np.empty((1, 1, H, hd), np.float32), np.empty((1, 1, Hkv, hd), np.float32)
        kv_rotate(qr[0, 0], rot, qs[0, 0])
        kv_rotate(kr[0, 0], rot, ks[0, 0])
        qr, kr = qs, ks
    K_STORE(k_store, kr, positions)  # noqa: F821
    V_STORE(v_store, v4, positions)  # noqa: F821
    ATTENTION(qr, k_store, v_store, positions, attn_scale, window, sinks, q4)  # noqa: F821 (q4: the output)
    att = np.empty(nq, np.float32)
    for i in range(nq):
        att[i] = q4[0, 0, i // hd, i % hd]
    yo = np.empty(D, np.float32)
    O_GEMV(o, att, yo)  # noqa: F821
    for d in range(D):
        h[0, d] += yo[d] + o_b[d]

    # ---- MoE ----
    RMS_NORM(h, ffn_norm, eps, x)
    logits = np.empty((1, router.shape[0]), np.float32)
    gemv_f32(router, x[0], logits[0])
    wts, ids = np.empty((1, top_k), np.float32), np.empty((1, top_k), np.int32)
    TOPK_SOFTMAX(logits, top_k, renorm, wts, ids)
    out = np.empty(D, np.float32)
    EXPERTS(gu, gu_perm, gu_G, dn, dn_perm, dn_G, x[0], ids[0], wts[0], out)  # noqa: F821
    if sh_gu.shape[0] > 0:  # the shared expert, gated (Qwen2-MoE) or not
        sg = np.empty((1, sh_gu.shape[0]), np.float32)
        gemv_f32(sh_gu, x[0], sg[0])
        sa = np.empty((1, sh_gu.shape[0] // 2), np.float32)
        SILU_AND_MUL(sg, sa)
        s = np.empty(D, np.float32)
        gemv_f32(sh_dn, sa[0], s)
        den = np.float32(1.0)
        if sh_gate.shape[0] > 0:
            gl = np.empty((1, 1), np.float32)
            gemv_f32(sh_gate, x[0], gl[0])
            den = gate_den(gl)[0, 0]
        for d in range(D):
            out[d] += s[d] / den
    for d in range(D):
        h[0, d] += out[d]


_LINEAR: dict = {}  # kernel suffix -> the _linear build of that decoder
PAR_CHUNKS = 16  # row ranges of a GEMV in the parallel build (prange shares them: balanced at 1, 2, 4, 8, 16 threads)


def suffix(prep) -> str:
    """The GEMV kernel-name suffix of a prepared weight: decoder, lanes, split (``toolkit/cpu/gemv.py``), or the
    integer kernel's code width (``igemm.StepWeight``)."""
    if isinstance(prep, StepWeight):
        return prep.suffix
    return f"__{prep.dec.name}_L{prep.L}_s{prep.split}"


def _linear_for(prep, parallel: bool = False):
    """The ``_linear`` template bound to one prepared weight's GEMV (its serial or parallel build), one per decoder;
    ``_linear_int8`` for a weight on int8 activations."""
    key = suffix(prep) + ("__par" if parallel else "")
    if key not in _LINEAR:
        if isinstance(prep, StepWeight):
            fn = twin(_linear_int8, key, IGEMV=prep.kernel.parallel if parallel else prep.kernel.serial,
                      QUANTIZE=quantize_rows)
        else:
            gemv = prep.gemv_kernel.parallel if parallel else prep.gemv_kernel.serial
            fn = twin(_linear, key, GEMV=gemv, HAS_ZERO=prep.dec.has_zero, CHUNKS=PAR_CHUNKS if parallel else 1)
        _LINEAR[key] = njit(cache=True, inline="always")(fn)
    return _LINEAR[key]


def dense_arg(w):
    """(spec, argument) of an attention projection's weight for the build: a dense f32 array -> (None, w); a
    16-bit dense QTensor -> its format's name and its uint16 bits when qlinear runs it on the plain 16-bit GEMV
    (``one_row_16``: a small weight), else its packing for the format's GEMV template (the kernel's prepared
    weight, and (arrays, x order, groups)): the kernel qlinear runs at one token, so the staged bits."""
    if isinstance(w, np.ndarray):
        return None, w
    if one_row_16(w):
        return w.fmt.name, w.arrays["weight"].view(np.uint16)
    p = kernel_for(w.fmt).prepare(w)
    return p, (p.arrays, np.ascontiguousarray(p.perm, np.int64) if p.perm is not None else np.zeros(1, np.int64),
               int(p.G))


def kernel(k_fmt: str, v_fmt: str, gate_up, down, parallel: bool = False, qkv=None, o=None):
    """The decode-layer build for cache formats (K, V) and the experts' prepared weights (their decoders and
    lanes), or dense f32 experts (``gate_up`` / ``down`` None); ``qkv`` / ``o``: the attention projections'
    specs (``dense_arg``; None: f32). ``parallel``: the build whose products (the experts' GEMVs, every dense
    product, attention over heads) run their parallel builds, for a layer big enough to split over threads; the
    same sums row by row, so the same bits as the serial build."""
    attn = (_dense_gemv(qkv, parallel), _dense_gemv(o, parallel))
    if gate_up is None:
        return _build(k_fmt, v_fmt, "__f32", None, None, parallel, None, attn)
    return _build(k_fmt, v_fmt, suffix(gate_up) + suffix(down), _linear_for(gate_up, parallel),
                  _linear_for(down, parallel), parallel, _rows_int8 if isinstance(gate_up, StepWeight) else _rows_gemv,
                  attn)


_DENSE16 = {"f16": gemv_f16, "bf16": gemv_bf16}
_DENSE: dict = {}  # (suffix, parallel) -> the _dense_packed build


def _dense_gemv(spec, parallel: bool):
    """(name suffix, GEMV) of an attention projection's spec (``dense_arg``); suffix '' for f32."""
    if spec is None:
        return "", None
    if isinstance(spec, str):
        return f"__a{spec}", _DENSE16[spec]
    key = (suffix(spec), parallel)
    if key not in _DENSE:
        _DENSE[key] = njit(cache=True, inline="always")(
            twin(_dense_packed, "__a" + key[0] + ("__par" if parallel else ""), LINEAR=_linear_for(spec, parallel)))
    return "__a" + key[0], _DENSE[key]


@functools.cache
def _build(k_fmt, v_fmt, e_suffix, gate_up, down, parallel: bool = False, gu_rows=None,
           attn=(("", None), ("", None))):
    p = "__par" if parallel else ""
    (qkv_name, qkv_gemv), (o_name, o_gemv) = attn
    a_suffix = f"__qkv{qkv_name}__o{o_name}" if qkv_name or o_name else ""
    name = f"__{k_fmt}_{v_fmt}{e_suffix}{a_suffix}{p}"
    dense = gemv_f32_parallel if parallel else gemv_f32
    if gate_up is None:
        experts = njit(cache=True, inline="always")(twin(_experts_f32, "__f32" + p, SILU_AND_MUL=SILU_AND_MUL,
                                                         gemv_f32=dense))
    else:
        experts = njit(cache=True, inline="always")(twin(_experts_packed, e_suffix, GATE_UP=gate_up, DOWN=down,
                                                         GU_ROWS=gu_rows))
    attention = attention_kernel(k_fmt, v_fmt)
    return njit(cache=True)(
        twin(_decode_layer, name, EXPERTS=experts, K_STORE=store_kernel(k_fmt).serial, gemv_f32=dense,
             QKV_GEMV=qkv_gemv or dense, O_GEMV=o_gemv or dense,
             V_STORE=store_kernel(v_fmt).serial, ATTENTION=attention.parallel if parallel else attention.serial))
