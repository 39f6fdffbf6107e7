"""Calibrated scales: an importance matrix (llama.cpp's imatrix) per routed expert projection, and the
quantizers that use it.

``imp[k]`` is the mean square of input column ``k`` over the calibration tokens routed to the expert (its
inputs: the layer input for gate/up, the SwiGLU output for down). Round-to-nearest with min/max scales
minimises nothing in particular; with the importance, each group's scale and offset are chosen to minimise
``sum_k imp[k] * (w[k] - w_hat[k])^2`` (the expected output error of that row on those inputs): a grid of
clipped ranges, each refined by weighted least squares for the given codes, the best kept. Experts that
calibration never reaches get the importance of tokens forced through them (``toolkit/quant/sensitivity.py``).

The stored arrays are exactly the format's (the same layout, codes from the f16-rounded scale and offset):
nothing downstream knows how the scales were picked. Formats without a calibrated quantizer here
(channel-wise int8/fp8, the GGML block types) quantize as before.
"""
from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..formats import Format, QTensor
from ..formats.packing import pack_ref
from ..formats.scalar import f16_bits, f16_value
from .keys import NAME, key_of

# shrink factors of the group's [min, max] range tried for each group (1.0: round-to-nearest's range)
SHRINK = np.array([1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.8, 0.75], np.float32)


def _affine_weighted(w: np.ndarray, fmt: Format, imp: np.ndarray) -> dict:
    """``w [N, K]``, ``imp [K] >= 0`` -> the affine format's arrays, scales and offsets searched per group."""
    g, qmax = fmt.group_size, np.float32((1 << fmt.bits) - 1)
    N, K = w.shape
    wg = w.reshape(N, K // g, g).astype(np.float32)  # [N, G, g]
    d = np.broadcast_to((imp.astype(np.float32) + np.float32(1e-12) * (imp.max() + 1)).reshape(1, K // g, g), wg.shape)
    lo, hi = wg.min(axis=-1), wg.max(axis=-1)  # [N, G]
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best_err = np.full(lo.shape, np.inf, np.float64)
    best_s, best_z = np.zeros_like(lo), lo.copy()
    sw, sw_w = d.sum(-1), (d * wg).sum(-1)  # [N, G]
    for r in SHRINK:
        s = np.maximum(2 * half * r / qmax, np.float32(1e-30))
        z = mid - half * r
        q = np.clip(np.rint((wg - z[..., None]) / s[..., None]), 0, qmax)
        # weighted least squares for (s, z) given the codes: minimise sum d (q s + z - w)^2
        sq, sqq, sqw = (d * q).sum(-1), (d * q * q).sum(-1), (d * q * wg).sum(-1)
        det = sw * sqq - sq * sq
        ok = np.abs(det) > 1e-20 * np.maximum(sw * sqq, 1e-30)
        s2 = np.where(ok, (sw * sqw - sq * sw_w) / np.where(ok, det, 1), s)
        z2 = np.where(ok, (sqq * sw_w - sq * sqw) / np.where(ok, det, 1), z)
        for ss, zz in ((s, z), (s2, z2)):
            sb, zb = f16_value(f16_bits(ss)), f16_value(f16_bits(zz))
            safe = np.where(sb == 0, np.float32(1), sb)
            qq = np.where(sb[..., None] == 0, 0, np.clip(np.rint((wg - zb[..., None]) / safe[..., None]), 0, qmax))
            err = (d * (qq * sb[..., None] + zb[..., None] - wg) ** 2).sum(-1, dtype=np.float64)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s, best_z = np.where(better, sb, best_s), np.where(better, zb, best_z)
    s_bits, z_bits = f16_bits(best_s), f16_bits(best_z)
    if (((s_bits & 0x7C00) == 0x7C00) | ((z_bits & 0x7C00) == 0x7C00)).any():
        raise FormatError(f"values up to {float(np.abs(w).max()):.4g} exceed the float16 range (65504) of group scales/offsets")
    s, z = f16_value(s_bits)[..., None], f16_value(z_bits)[..., None]
    safe = np.where(s == 0, np.float32(1), s)
    q = np.where(s == 0, np.float32(0), np.clip(np.rint((wg - z) / safe), 0, qmax)).astype(np.uint8)
    return {"qweight": pack_ref(q.reshape(N, K), fmt.bits), "scales": s_bits.view(np.float16), "biases": z_bits.view(np.float16)}


WEIGHTED = {"affine": _affine_weighted}  # integer form (Format.int_form) -> calibrated quantizer


def calibrated(fmt: Format) -> bool:
    return fmt.int_form in WEIGHTED


def quantize_weighted(fmt: Format, w: np.ndarray, imp: np.ndarray | None, backend: str = "numba", name: str = "weight") -> QTensor:
    """``w [N, K]`` in ``fmt`` with scales calibrated on ``imp [K]`` (None, or a format without a calibrated
    quantizer: the format's own round-to-nearest)."""
    if imp is None or not calibrated(fmt):
        return fmt.quantize(w, backend, name=name)
    w = np.asarray(w, np.float32)
    fmt.check_shape(w.shape, name)
    from ..formats import check_finite

    check_finite(w, name)
    if imp.shape != (w.shape[-1],) or not np.isfinite(imp).all() or (imp < 0).any():
        raise FormatError(f"tensor {name!r}: importance of shape {list(imp.shape)} does not fit its {w.shape[-1]} "
                          f"input columns (or holds negative / non-finite values)")
    try:
        arrays = WEIGHTED[fmt.int_form](w, fmt, imp)
    except FormatError as e:
        raise FormatError(f"tensor {name!r}: {e}") from None
    qt = QTensor(fmt, tuple(w.shape), arrays)
    qt.validate(name)
    return qt


# ---- the imatrix file (safetensors: one f32 [K] vector per expert projection) ---------------------------
def save_imatrix(path, imp: dict, meta: dict | None = None) -> None:
    """``imp {(layer, proj, e): [K]}`` -> safetensors ``layers.{i}.moe.{proj}.{e}`` (atomically)."""
    from ..model.safetensors_io import save_file

    from ..writes import WRITER

    save_file({f"layers.{i}.moe.{p}.{e}": np.asarray(v, np.float32) for (i, p, e), v in imp.items()}, path,
              metadata={**{k: str(v) for k, v in (meta or {}).items()}, "writer": WRITER, "kind": "imatrix"})


def load_imatrix(path) -> dict:
    """The inverse of :func:`save_imatrix` -> ``{(layer, proj, e): [K] f32}``; refuses a file that is not one."""
    from ..model.safetensors_io import SafeTensorsFile

    f = SafeTensorsFile(path)
    out = {}
    for name in f.keys():
        m = NAME.match(name)
        a = np.asarray(f.get(name), np.float32)
        if m is None or a.ndim != 1 or not np.isfinite(a).all() or (a < 0).any():
            raise FormatError(f"{path}: tensor {name!r} is not an importance vector (layers.I.moe.PROJ.E, 1-D, finite, >= 0)")
        out[key_of(name, str(path))] = a
    if not out:
        raise FormatError(f"{path}: holds no importance vector")
    return out
