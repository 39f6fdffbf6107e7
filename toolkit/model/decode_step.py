"""The compiled decode step: a layer at one token as one Numba call (``toolkit/cpu/decode_layer.py``).

``compiled_step(layer)`` returns ``step(h [1, D], pos, cache)`` (h updated in place) for a layer the compiled
kernel covers, or None, and the layer keeps running its staged stages. Covered: the ``numba`` backend; GQA
attention (q/k norms per head or over the projection, biases, clip) with dense f32 or 16-bit projections; the softmax
router without a logit bias; routed experts in f32 or any weight-only format with a CPU decoder and the plain
SwiGLU (no expert biases); an optional f32 shared expert with or without its sigmoid gate; a key cache
rotated or not (``KVCache(rotate_k=True)``: the kernel rotates with the cache's own ``kv_rotate``). That is
Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE under the ``none`` and ``moqe`` policies. Not covered (staged): MLA,
gpt-oss, grouped routers, quantized attention or router (the all-linear policies), W8A8 experts and batches of more
than one sequence. Experts on int8 activations (the default for the integer formats) run the integer one-row
kernel (``toolkit/cpu/igemm.py``); the activation kind is read when the step is built, as the load reads it. A
layer whose decode work is large enough for the parallel kernels, with more than one thread configured, runs the
parallel build (``MoEModel`` picks per step).
"""
from __future__ import annotations

import time

import numpy as np

from ..cpu import api as cpu
from ..formats import QTensor
from ..formats.base import readonly
from .kv_cache import KVCache

RECHECK_S = 2.0  # "cached" / "auto": a build found missing is looked for again (in this process, then on disk) after this
# long, not at every token (the disk look reads the cache's index: ~0.1 ms a layer), so a step another thread
# compiles meanwhile (the app's warm-up) is picked up within seconds


def _dense_ok(lin, sixteen: bool = False) -> bool:
    """A dense f32 weight (``sixteen``: or a dense 16-bit one, as ``Runtime.dense`` keeps attention's)."""
    if lin is None:
        return False
    w = lin.weight
    if sixteen and isinstance(w, QTensor):
        return not w.fmt.quantized and w.fmt.bits == 16 and len(w.shape) == 2
    return isinstance(w, np.ndarray) and w.dtype == np.float32


def _size(w) -> int:
    return int(np.prod(w.shape))


def covers(layer) -> bool:
    """Whether the compiled decode step can run ``layer`` (see the module docstring)."""
    from .attention import GQAAttention
    from .moe import MoEBlock

    cfg, attn, ffn = layer.cfg, layer.attn, layer.ffn
    if not layer.rt.caps.compiled_decode or not isinstance(attn, GQAAttention) or not isinstance(ffn, MoEBlock):
        return False
    if not (_dense_ok(attn.qkv, True) and _dense_ok(attn.o, True)) or attn.sinks is not None:
        return False
    if not cfg.family.compiled or not _dense_ok(ffn.router) or ffn.router.bias is not None:
        return False
    if ffn.expert_weights is None:
        return False
    for w in ffn.expert_weights:
        if isinstance(w, QTensor):
            if cpu.int8_applies(w):
                continue
            if w.fmt.act_quant is not None or w.fmt.cpu_decoder not in cpu.DECODERS:
                return False
        elif not (isinstance(w, np.ndarray) and w.dtype == np.float32):
            return False
    if ffn.shared is not None:
        gate_up, down, gate = ffn.shared
        if not all(_dense_ok(l) and l.bias is None for l in (gate_up, down)) or (gate is not None and not _dense_ok(gate)):
            return False
    return True


def decode_work(layer) -> int:
    """Multiply-adds of one token through the layer's weights (the size the thread picker compares)."""
    attn, ffn = layer.attn, layer.ffn
    n = _size(attn.qkv.weight) + _size(attn.o.weight) + ffn.router.weight.size
    gu, dn = ffn.expert_weights
    n += layer.cfg.top_k * (int(np.prod(gu.shape[1:])) + int(np.prod(dn.shape[1:])))
    if ffn.shared is not None:
        n += sum(l.weight.size for l in ffn.shared if l is not None)
    return n


def compiled_step(layer):
    """``step(h, pos, cache, inv_freq, rope_scale)`` running ``layer`` at one token through the compiled
    kernel (h [1, D] updated in place), or None."""
    if not covers(layer):
        return None
    cfg, attn, ffn = layer.cfg, layer.attn, layer.ffn
    D = cfg.hidden_size
    zeros = lambda *shape: readonly(np.zeros(shape, np.float32))  # noqa: E731
    no_perm = np.zeros(1, np.int64)  # mutable int64, the type of the kernels' own index arrays

    def prepared(w):  # (the kernels' view of an expert weight, its (arrays, x order, scale groups) arguments)
        if cpu.int8_applies(w):  # the integer one-row kernel: no x order, no group sums
            p = cpu.step_weight(w)
            return p, (p.arrays, no_perm, 1)
        p = cpu.kernel_for(w.fmt).prepare(w)
        return p, (p.arrays, np.ascontiguousarray(p.perm, np.int64) if p.perm is not None else no_perm, int(p.G))

    gu_w, dn_w = ffn.expert_weights
    if isinstance(gu_w, QTensor):
        (gu, gu_args), (dn, dn_args) = prepared(gu_w), prepared(dn_w)
        experts = gu_args + dn_args
    else:  # dense f32 experts
        gu = dn = None
        experts = ((gu_w,), no_perm, 1, (dn_w,), no_perm, 1)
    sh_gu = sh_dn = sh_gate = zeros(0, D)
    if ffn.shared is not None:
        s_gu, s_dn, s_gate = ffn.shared
        sh_gu, sh_dn = s_gu.weight, s_dn.weight
        sh_gate = s_gate.weight if s_gate is not None else zeros(0, D)
    nqkv = attn.qkv.weight.shape[0]
    (qkv_spec, qkv_w), (o_spec, o_w) = cpu.dense_arg(attn.qkv.weight), cpu.dense_arg(attn.o.weight)
    head = (np.float32(cfg.rms_norm_eps), layer.attn_norm, layer.ffn_norm,
            qkv_w, attn.qkv.bias if attn.qkv.bias is not None else zeros(nqkv),
            o_w, attn.o.bias if attn.o.bias is not None else zeros(D),
            attn.q_norm if attn.q_norm is not None else zeros(0), attn.k_norm if attn.k_norm is not None else zeros(0),
            np.float32(attn.clip or 0.0))
    moe = (ffn.router.weight, int(cfg.top_k), bool(cfg.norm_topk_prob), *experts, sh_gu, sh_dn, sh_gate,
           (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    index, window, scale = attn.index, int(attn.window), np.float32(cfg.attn_scale)
    sinks = np.full(cfg.num_heads, -np.inf, np.float32)  # none (mutable: the type the staged path passes)
    no_rot = zeros(0, 0)  # an unrotated key cache (a rotated one passes its [hd, hd] Hadamard matrix, read-only)
    builds, ready = {}, {}

    def step(h, pos: int, cache: KVCache, inv_freq, rope_scale, mode: str = "cached", parallel: bool = False) -> bool:
        """Run the layer on ``h [1, D]`` in place and return True, or return False having done nothing (the
        build is not compiled and ``mode`` is "cached" or "auto": the caller runs the staged layer; "auto" also
        records the build in ``step.missing``, for a background compile after the run; "record" only records it
        and never runs a build: ``toolkit/model/coldstart.py``'s helper). ``parallel``: the
        build whose products split over the threads (a layer of ``PARALLEL_MIN_WORK`` or more, threads > 1)."""
        key = (cache.k_fmt.name, cache.v_fmt.name, parallel)
        if key not in builds:
            builds[key] = cpu.decode_layer_kernel(*key[:2], gu, dn, parallel=parallel, qkv=qkv_spec, o=o_spec)
        rot = cache.rotation.weight if cache.rotation is not None else no_rot
        args = (h, pos, *head, inv_freq, np.float32(rope_scale), cache.k[index], cache.v[index], rot, scale,
                window, sinks, *moe)
        if mode == "record":  # never run: only note a build that is neither compiled nor cached
            if not cpu.ready(builds[key], args, compile=False):
                step.missing[key] = (builds[key], cpu.signature(args))
            return False
        hit = ready.get((key, mode))  # True, or when it was last found missing (looked for again after RECHECK_S)
        if hit is not True:
            if hit is not None and time.monotonic() - hit < RECHECK_S:
                return False
            ready[(key, mode)] = True if cpu.ready(builds[key], args, compile=mode == "on") else time.monotonic()
            if ready[(key, mode)] is not True:
                if mode == "auto":  # built later, for the next runs (``MoEModel.missing_builds``)
                    step.missing[key] = (builds[key], cpu.signature(args))
                return False
            step.missing.pop(key, None)
        builds[key](*args)
        return True

    step.work = decode_work(layer)
    step.builds = builds  # (K cache, V cache, parallel) -> the build, for tests and reports
    step.missing = {}  # "auto": (K cache, V cache, parallel) -> (build, signature) found neither compiled nor cached
    return step
