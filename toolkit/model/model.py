"""The MoE decoder as named stages (embedding, RMSNorm, rotary, GQA attention with KV cache, router,
experts, combine, final norm, LM head), each op resolved once from ``toolkit.ops`` for one backend.

Shape legend: ``B`` sequences, ``T`` new tokens per sequence, ``D`` hidden, ``H``/``Hkv`` heads,
``hd`` head dim, ``E`` experts, ``A`` active experts per token, ``V`` vocabulary.
"""
from __future__ import annotations

import numpy as np

from ..cpu import api as cpu
from ..errors import ModelError
from ..formats import QTensor
from ..gpu import api as gpu
from ..threads import threads
from .attention import ATTENTION_PARTS
from .config import ModelConfig
from .kv_cache import KVCache, parse_kv_cache
from .linear import Linear
from .moe import DenseMLP, MoEBlock
from .runtime import Runtime
from .weights import LayerWeights, ModelWeights


class DecoderLayer:
    """Pre-norm residual layer: ``h += attention(norm(h)); h += ffn(norm(h))``, the attention part chosen by
    the family's attention part (``toolkit/model/attention.py``), the FFN a routed MoE block or a dense MLP."""

    def __init__(self, cfg: ModelConfig, index: int, w: LayerWeights, rt: Runtime, experts=None):
        self.cfg, self.rt = cfg, rt
        self.attn = ATTENTION_PARTS[type(cfg.family.attention)](cfg, index, w.attn, rt)
        self.attn_norm, self.ffn_norm = rt.weight(w.attn_norm), rt.weight(w.ffn_norm)
        self.rms_norm = rt.op("rms_norm")
        self.ffn = MoEBlock(cfg, w.moe, rt, experts, index) if w.moe is not None else DenseMLP(w.mlp, rt)

    def __call__(self, h, positions, cache: KVCache, inv_freq, rope_scale, rows=None):  # h [B*T, D] -> [B*T or R, D]
        """``rows`` (host int array [R], or None: all): the rows that go on past the attention, which reads and
        caches every token; the FFN runs on those rows only (``MoEModel._forward``: a prefill's last layer, whose
        other rows no logit needs)."""
        eps, rt = self.cfg.rms_norm_eps, self.rt
        h = rt.add(h, self.attn(self.rms_norm(h, self.attn_norm, eps), positions, cache, inv_freq, rope_scale))
        if rows is not None:
            h = rt.gather_rows(h, rows)  # [R, D]
        return rt.add(h, self.ffn(self.rms_norm(h, self.ffn_norm, eps)))


KV_ROTATE_AUTO: tuple[str, ...] = ("q4_0",)  # K cache types rotated by default (kv_rotate "auto"; see docs/kv-cache.md)


class MoEModel:
    """A decoder-only MoE language model on one backend. ``forward`` is prefill and decode alike; on ``numba``
    a one-token step of one sequence runs each layer the compiled decode step covers as one Numba call
    (``compiled_decode``, ``toolkit/model/decode_step.py``), the same bits as the staged stages.
    On ``cuda`` / ``cuda-emu`` every weight lives on the device from the start, and so do the KV cache
    and the activations: a call copies in the token ids and nothing else (``decode`` replays a recorded
    step; ``toolkit/model/generate.py`` samples on the device and copies out only the sampled ids)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, backend: str = "numba", experts=None,
                 kv_cache: str | tuple | None = None, activations: str | None = None, places=None):
        """``places``: the routed experts that live on the host (:class:`toolkit.model.placement.Places`, from
        ``placement.resolve``; None: all where the backend computes)."""
        self.cfg, self.backend = cfg, backend
        self.rt = rt = Runtime(backend, activations, places)
        self.kv_types = parse_kv_cache(kv_cache)
        # Embeddings and LM head in the checkpoint's own 16-bit type when that holds them exactly: half the
        # bytes of the head, the largest weight a decode step reads (Runtime.keeps16 says where: on numba always,
        # a small head at one token taking the plain 16-bit GEMV; bundled model, 8192 x 256: 16-bit GEMV 280 us
        # against 455-490 us for f32 BLAS in a decode step). The loaders (Runtime.placing) make them so as they
        # arrive; weights built otherwise are narrowed here.
        tied = weights.lm_head is weights.embed
        keeps16 = lambda role: rt.keeps16(role, cfg.hidden_size, tied, cfg.torch_dtype)
        embed = rt.stored_precision(weights.embed, cfg.torch_dtype) if keeps16("embed") else weights.embed
        self.embed = embed if isinstance(embed, QTensor) else rt.weight(embed)  # [V, D]
        self.norm = rt.weight(weights.norm)
        head = embed if tied else rt.stored_precision(weights.lm_head, cfg.torch_dtype) if keeps16("lm_head") else weights.lm_head
        self.lm_head = Linear(head, rt=rt)  # [V, D]: qlinear's 16-bit decoder when kept in f16 / bf16
        experts = experts or {}
        self.layers = [DecoderLayer(cfg, i, lw, rt, experts.get(i)) for i, lw in enumerate(weights.layers)]
        self.rms_norm = rt.op("rms_norm")
        inv_freq, self.rope_scale = cfg.rope_inv_freq()
        self.inv_freq = rt.weight(inv_freq)
        self._plans: dict = {}
        # numba, one token: each layer as one compiled call (toolkit/model/decode_step.py), the same bits as the
        # staged stages. "cached": when its build is compiled or in Numba's disk cache (``moqe warmup`` compiles
        # it; a cold run never waits for it); "auto": as "cached", and a build found missing is kept in
        # ``missing_builds()`` for a background compile after the run (the CLI's default); "on": compile it when
        # first needed; "off": always staged.
        self.compiled_decode = "on"  # compiled on first use (once: Numba's disk cache keeps it); "cached", "auto", "off"
        self.decode_paths = {"compiled": 0, "staged": 0}  # layer steps at one token, by the path that ran them
        self._steps = None
        self.record_decode = True  # on a device, record the decode step once and replay it (off: a hook reads each step)
        self.cuda_graphs = False  # on a GPU, capture the recorded decode step as a CUDA graph (--cuda-graphs)
        # keys stored rotated by a Hadamard matrix (queries too): "on", "off", or "auto" = KV_ROTATE_AUTO's K types
        self.kv_rotate = "auto"

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        if max_len > self.cfg.max_position_embeddings:
            raise ModelError(f"a context of {max_len} tokens exceeds the model's max_position_embeddings "
                             f"({self.cfg.max_position_embeddings})")
        heads, row, shared = self.cfg.kv_layout
        if shared and self.kv_types[0] != self.kv_types[1]:
            raise ModelError(f"this model's cache holds one latent row per token (MLA), read as both key and value: "
                             f"give one cache type, not k={self.kv_types[0]},v={self.kv_types[1]}")
        rotate = self.kv_rotate == "on" or (self.kv_rotate == "auto" and self.kv_types[0] in KV_ROTATE_AUTO and not shared
                                            and row & (row - 1) == 0)
        return KVCache(self.cfg.num_layers, batch, heads, max_len, row, self.kv_types, self.rt, shared_v=shared,
                       rotate_k=rotate)

    def _check(self, tokens: np.ndarray, cache: KVCache) -> None:
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ModelError(f"token ids must lie in [0, {self.cfg.vocab_size}); got {tokens.min()}..{tokens.max()}")
        if np.any(cache.lens + tokens.shape[1] > cache.max_len):
            raise ModelError(f"{int((cache.lens + tokens.shape[1]).max())} tokens exceed the cache's context of {cache.max_len}")

    def forward(self, tokens: np.ndarray, cache: KVCache, lengths: np.ndarray | None = None,
                last_only: bool = False):
        """``tokens [B, T]`` (right-padded to T; ``lengths [B]`` valid tokens each) appended after what
        ``cache`` holds -> logits ``[B, T, V]`` (``[B, V]`` at each sequence's last token with last_only),
        arrays of the backend (device arrays on ``cuda`` / ``cuda-emu``)."""
        tokens = np.asarray(tokens)
        B, T = tokens.shape
        lengths = np.full(B, T, np.int64) if lengths is None else np.asarray(lengths, np.int64)
        self._check(tokens, cache)
        return self._forward(self.rt.ids(tokens), cache, lengths, last_only)

    def _forward(self, ids, cache: KVCache, lengths: np.ndarray, last_only: bool):
        """The forward pass on backend arrays: ``ids [B, T]`` already placed."""
        rt = self.rt
        B, T = ids.shape
        positions = cache.advance(lengths, T)  # [B, T]; the cache now counts these tokens
        h = rt.embedding(ids.reshape(-1), self.embed)  # [B*T, D]
        steps = self._compiled_steps() if B == 1 and T == 1 else None
        # With last_only, the last layer's FFN runs on each sequence's last token only: the attention still
        # caches every token, and no other row reaches a logit (llama.cpp prunes its last layer the same way).
        last = np.arange(B) * T + lengths - 1 if last_only and T > 1 else None  # [B] rows of h
        for i, layer in enumerate(self.layers):
            s = steps[i] if steps is not None else None
            if s is None or not s(h, int(positions[0, 0]), cache, self.inv_freq, self.rope_scale, self.compiled_decode,
                                  threads() > 1 and s.work >= cpu.PARALLEL_MIN_WORK):
                rows = last if i == len(self.layers) - 1 else None
                h = layer(h, positions, cache, self.inv_freq, self.rope_scale, rows)  # else h [1, D] updated in place
                if T == 1:
                    self.decode_paths["staged"] += B
            else:
                self.decode_paths["compiled"] += 1
        if last is not None and not self.layers:
            h = rt.gather_rows(h, last)  # [B, D]
        x = self.rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        logits = self.lm_head(x)  # [B or B*T, V]
        return logits if last_only else logits.reshape(B, T, self.cfg.vocab_size)

    def _compiled_steps(self) -> list | None:
        """Per layer, its compiled decode step (``toolkit/model/decode_step.py``) or None (staged); built once.
        A layer big enough for the parallel kernels runs the step's parallel build when more than one thread is set."""
        if self.compiled_decode == "off" or not self.rt.caps.compiled_decode:
            return None
        if self._steps is None:
            from .decode_step import compiled_step

            self._steps = [compiled_step(layer) for layer in self.layers]
        return self._steps

    def missing_builds(self) -> list:
        """[(dispatcher, signature)] of the compiled decode steps this model's one-token steps asked for and found
        neither compiled nor in the disk cache (``compiled_decode = "auto"``), each build once: what
        ``toolkit/cpu/_detached.py`` compiles for the next runs."""
        out = {}
        for s in self._steps or ():
            for build, sig in (s.missing.values() if s is not None else ()):
                out[(id(build), sig)] = (build, sig)
        return [(b, sig) for b, sig in out.values() if not cpu.ready_sig(b, sig, compile=False)]  # (another process
        # may have built it since)

    def decode(self, tokens: np.ndarray, cache: KVCache):
        """One decode step, ``tokens [B]`` -> logits ``[B, V]`` (backend arrays). On a device the step is
        recorded the first time per (batch, cache) and replayed after: only the token ids are copied in."""
        tokens = np.asarray(tokens).reshape(-1, 1)
        self._check(tokens, cache)
        if not self.rt.on_device or self.rt.places is not None or not self.record_decode:  # a hybrid step copies the
            # routing out: not recorded
            return self._forward(self.rt.ids(tokens), cache, np.ones(len(tokens), np.int64), True)
        dev, key = self.rt.device, (len(tokens), id(cache))
        if key not in self._plans:
            tok = dev.to_device(tokens.astype(np.int32))
            plan = gpu.Plan()
            with dev.recording(plan):
                logits = self._forward(tok, cache, np.ones(len(tokens), np.int64), True)
            if self.cuda_graphs:
                plan.capture(dev)  # replays from the next step on launch the graph
            self._plans = {key: (plan, tok, logits, cache)}  # one live plan: a new cache replaces it
            return logits
        plan, tok, logits, _ = self._plans[key]
        dev.copy_in(tok, tokens.astype(np.int32))
        cache.lens += 1  # the host's count (the device's advances inside the plan)
        plan.replay(dev)
        return logits

    # ---- accounting ---------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Host bytes the model's arrays hold as the kernels read them, each buffer once: a quantized weight by
        its packed layout where one was made (its stored pages then handed back or never read), else by its
        stored arrays; mapped file pages count as they would when read. The KV cache is not included."""
        spans, seen, todo = [], set(), [self.__dict__]
        while todo:
            o = todo.pop()
            if id(o) in seen or o is self.rt:
                continue
            seen.add(id(o))
            if isinstance(o, np.ndarray):
                if o.size:
                    spans.append((o.ctypes.data, o.ctypes.data + o.nbytes))
            elif isinstance(o, QTensor):
                todo.extend(cpu.held_arrays(o))
            elif isinstance(o, dict):
                todo.extend(o.values())
            elif isinstance(o, list | tuple):
                todo.extend(o)
            elif type(o).__module__.startswith("toolkit.") and hasattr(o, "__dict__"):
                todo.append(o.__dict__)
        total, end = 0, 0
        for lo, hi in sorted(spans):  # the union of the address ranges: views of one buffer counted once
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        return total

    def weight_bytes(self) -> dict:
        """Bytes held by weights, split into experts / attention / other; ``host experts``: the routed experts'
        bytes a placement keeps on the host (included in ``experts``)."""
        out = {"experts": 0, "attention": 0, "other": self.embed.nbytes + self.norm.nbytes + self.lm_head.nbytes,
               "host experts": 0}
        for layer in self.layers:
            out["attention"] += layer.attn.nbytes
            out["other"] += layer.attn_norm.nbytes + layer.ffn_norm.nbytes + layer.attn.norm_bytes
            ffn = layer.ffn
            if isinstance(ffn, MoEBlock):
                out["experts"] += ffn.experts.nbytes
                out["host experts"] += getattr(ffn.experts, "host_nbytes", 0)
                out["other"] += ffn.other_bytes
            else:
                out["other"] += ffn.gate_up.nbytes + ffn.down.nbytes
        return out
