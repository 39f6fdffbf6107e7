"""The CUDA backend's ops on device-resident arrays: what ``get_op(name, "cuda")`` (a GPU) and
``get_op(name, "cuda-emu")`` (the CPU emulation) return.

Each op takes and returns arrays of its device (``toolkit/gpu/device.py``) and is one launch plan of
``toolkit/gpu/<op>.py`` (``run_<op>``) run on that device: nothing is copied between host and
device here, no value is read back, and every grid depends on shapes only, so a model step built from
these ops can be recorded once and replayed (or captured as a CUDA graph).

Quantized weights are :class:`~toolkit.formats.QTensor` objects whose arrays live on the device
(``upload_qtensor``); ``qlinear`` runs ``moe_gemm`` with one expert.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..errors import BackendError
from .device import device as device_of

BLOCK_M = 16  # the M-block of qlinear's single-expert moe_gemm (fused_moe takes moe_gemm_mma.block_m_for)


def upload_qtensor(dev, qt, role: str | None = None):
    """A QTensor with its arrays copied to ``dev`` (once, at load). Routed experts (``role`` 'moe.gate_up' /
    'moe.down') in affine int2/3/4, a GGML block of 32 (q4_0, q4_1, q5_0, q5_1, q8_0, mxfp4) or q2_K..q6_K
    go up repacked for the tensor-core GEMM when the device runs it
    (:mod:`toolkit.gpu.mma_pack`; gate_up with its gate and up halves side by side, for the fused silu)."""
    from .mma_pack import pack, packable
    from .moe_gemm_mma import tensor_cores

    repack = role in ("moe.gate_up", "moe.down") and tensor_cores(dev) and packable(qt)
    if repack and getattr(dev, "stream", None) is not None:  # a GPU: the stored bytes go up, the GPU permutes them
        up = dataclasses.replace(qt, arrays={k: dev.to_device(np.ascontiguousarray(a)) for k, a in qt.arrays.items()})
        with dev.stream:  # ordered after the copies (the device's own stream)
            return pack(up, halves=role == "moe.gate_up")
    if repack:
        qt = pack(qt, halves=role == "moe.gate_up")
    return dataclasses.replace(qt, arrays={k: dev.to_device(np.ascontiguousarray(a)) for k, a in qt.arrays.items()})


class DeviceOps:
    """The ops of one device, by the op names of ``toolkit.ops``."""

    def __init__(self, dev):
        self.dev = dev
        self._consts: dict = {}

    def const(self, key, make):
        """A device array built once per process and key (shape-derived constants: never per step)."""
        if key not in self._consts:
            self._consts[key] = self.dev.to_device(make())
        return self._consts[key]

    # ---- the model's ops ---------------------------------------------------------------------------------
    def rms_norm(self, x, w, eps):
        from .rms_norm import run_rms_norm

        return run_rms_norm(self.dev, x, w, eps)

    def rope(self, x, positions, inv_freq, scale=1.0):
        from .rope import run_rope

        run_rope(self.dev, x, positions, inv_freq, np.float32(scale))
        return x

    def topk_softmax(self, logits, k, renormalize):
        from .topk_softmax import run_topk_softmax

        return run_topk_softmax(self.dev, logits, k, renormalize)

    def topk_sigmoid(self, logits, bias, k, n_group, topk_group, renormalize, scale):
        from .topk_sigmoid import run_topk_sigmoid

        if bias is None:
            bias = self.const(("zeros", logits.shape[1]), lambda: np.zeros(logits.shape[1], np.float32))
        return run_topk_sigmoid(self.dev, logits, bias, k, n_group, topk_group, renormalize, scale)

    def topk_softmax_grouped(self, logits, k, n_group, topk_group, scale):
        from .topk_softmax_grouped import run_topk_softmax_grouped

        return run_topk_softmax_grouped(self.dev, logits, k, n_group, topk_group, scale)

    def silu_and_mul(self, x):
        from .silu_and_mul import run_silu_and_mul

        return run_silu_and_mul(self.dev, x)

    def clamped_swiglu(self, x, alpha, limit):
        from .clamped_swiglu import run_clamped_swiglu

        return run_clamped_swiglu(self.dev, x, alpha, limit)

    def moe_bias_add(self, y, bias, ids, weights=None):
        from .moe_bias_add import run_moe_bias_add

        return run_moe_bias_add(self.dev, y, bias, ids, weights)

    def fused_moe(self, x, topk_weights, topk_ids, gate_up, down, bias=None, act=None, expert_map=None):
        """``expert_map``: int32 [E_total] device array (global -> local expert id, -1: not here) or None."""
        from .fused_moe import run_fused_moe

        from .moe_gemm_mma import block_m_for, has_wide

        # moe_align's block from the table (16 at decode, 64 once experts fill 64-row blocks, 128 once they fill
        # 128-row blocks where both GEMMs have a 128-token tensor-core kernel: prefill), by shapes and formats only
        wide = has_wide(self.dev, gate_up) and has_wide(self.dev, down)
        block_m = block_m_for(topk_ids.shape[0] * topk_ids.shape[1], gate_up.shape[0], wide)
        return run_fused_moe(self.dev, x, topk_weights, topk_ids, gate_up, down, block_m, bias, act, expert_map)

    def moe_experts(self, x, ids, weights, gate_up, down, bias=None, act=None):
        """f32 experts ``[E, 2I, D]`` / ``[E, D, I]``: the same grouped pipeline with the unquantized decoder."""
        from ..formats import QTensor, get_format

        f32 = get_format("f32")
        wrap = lambda a: QTensor(f32, tuple(a.shape), {"weight": a})  # noqa: E731
        return self.fused_moe(x, weights, ids, wrap(gate_up), wrap(down), bias, act)

    def qlinear(self, x, w):
        """``x [T, K] @ w.T`` for a quantized ``w [N, K]``: moe_gemm with one expert and every token routed to it."""
        from .moe_gemm import run_moe_gemm

        T = x.shape[0]
        P = -(-T // BLOCK_M) * BLOCK_M
        sorted_ids = self.const(("qlinear_ids", T), lambda: np.where(np.arange(P) < T, np.arange(P), T).astype(np.int32))
        expert_ids = self.const(("qlinear_experts", P), lambda: np.zeros(P // BLOCK_M, np.int32))
        w3 = dataclasses.replace(w, shape=(1, *w.shape), arrays={k: a.reshape(1, *a.shape) for k, a in w.arrays.items()})
        return run_moe_gemm(self.dev, x, w3, sorted_ids, expert_ids, BLOCK_M, 1)

    def linear(self, x, w, b=None):
        """``x [T, K] @ w [N, K].T (+ b)`` for a dense f32 weight: one GEMM (``Device.gemm``: cuBLAS on a GPU,
        cuda_src/linear.cu in a recorded step there)."""
        out = self.dev.empty((x.shape[0], w.shape[0]), np.float32)
        self.dev.gemm(x, w, out)
        if b is not None:
            self.bias_add(out, b)
        return out

    def kv_store(self, store, fmt, x, positions):
        from .kv_store import run_kv_store

        run_kv_store(self.dev, store, fmt, x, positions)

    def kv_attention(self, q, k_store, v_store, k_fmt, v_fmt, positions, scale, window=0, sinks=None):
        from .kv_attention import run_kv_attention

        return run_kv_attention(self.dev, q, k_store, v_store, k_fmt, v_fmt, positions, scale, window,
                                max_keys=int(k_store.shape[2]), sinks=sinks)

    def mla_q(self, q, w_uk, positions, inv_freq, scale, interleave):
        from .mla_q import run_mla_q

        return run_mla_q(self.dev, q, w_uk, positions, inv_freq, scale, interleave)

    def mla_kv(self, kv, norm_w, eps, positions, inv_freq, scale, interleave):
        from .mla_kv import run_mla_kv

        return run_mla_kv(self.dev, kv, norm_w, eps, positions, inv_freq, scale, interleave)

    def mla_out(self, att, w_uv):
        from .mla_out import run_mla_out

        return run_mla_out(self.dev, att, w_uv)

    def embedding(self, ids, table):
        from .embedding import run_embedding

        return run_embedding(self.dev, ids, table)

    def add(self, h, y):
        from .add import run_add

        run_add(self.dev, h, y)
        return h

    def add_rows(self, h, y, rows):
        from .add_rows import run_add_rows

        run_add_rows(self.dev, h, y, rows)
        return h

    def bias_add(self, x, b):
        from .bias_add import run_bias_add

        run_bias_add(self.dev, x, b)
        return x

    def gated_add(self, h, y, s, g):
        from .gated_add import run_gated_add

        run_gated_add(self.dev, h, y, s, g)
        return h

    def clip(self, x, c):
        """``x`` clamped to ``[-c, c]`` in place (the model passes fresh projection outputs); returns x."""
        from .clip import run_clip

        run_clip(self.dev, x, c)
        return x

    def gather_rows(self, x, rows):
        from .gather_rows import run_gather_rows

        return run_gather_rows(self.dev, x, rows)

    def positions(self, lens, lengths, T):
        from .positions import run_positions

        return run_positions(self.dev, lens, lengths, T)

    def sample(self, logits, temperature, top_k, top_p, repetition_penalty, seed, step, seen, scratch=None):
        from .sample import run_sample

        return run_sample(self.dev, logits, temperature, top_k, top_p, repetition_penalty, seed, step, seen,
                          scratch=scratch)

    def mark_seen(self, ids, lengths, seen):
        from .sample import run_mark_seen

        run_mark_seen(self.dev, ids, lengths, seen)

    def nll(self, logits, targets):
        from .nll import run_nll

        return run_nll(self.dev, logits, targets)


# the ops this backend implements, by their names in toolkit.ops (toolkit.ops.supports_op): DeviceOps' public methods
DEVICE_OPS = frozenset(n for n, f in vars(DeviceOps).items() if callable(f) and not n.startswith("_") and n != "const")


@functools.cache
def ops_for(backend: str) -> DeviceOps:
    return DeviceOps(device_of(backend))


def op(name: str, backend: str):
    if name not in DEVICE_OPS:
        raise BackendError(f"op {name!r} has no {backend!r} implementation")
    return getattr(ops_for(backend), name)
