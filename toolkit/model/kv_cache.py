"""The KV cache: preallocated per layer in a cache format (f32, q8_0, q4_0), chosen for K and V separately.

Stores are ``[B, Hkv, S, row]``: ``row`` is ``hd`` f32 values, or ``hd/32`` GGML blocks (34 bytes for
q8_0, 18 for q4_0) along the head dim. New rows are quantized on write (``kv_store``) at their absolute
positions; attention reads the stored blocks directly (``kv_attention``). Nothing reallocates per token.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError
from ..formats import FORMATS, get_format

CACHE_TYPES = tuple(f.name for f in FORMATS.values() if f.kv_row)  # the formats with a KV row codec: f32, q8_0, q4_0


def parse_kv_cache(spec: str | tuple | None) -> tuple[str, str]:
    """``q4_0`` (K and V), ``k=q8_0,v=q4_0``, or a (k, v) tuple -> (k type, v type)."""
    if spec is None:
        return "f32", "f32"
    if isinstance(spec, tuple):
        k, v = spec
    elif "=" in spec:
        parts = dict(p.split("=", 1) for p in spec.replace(" ", "").split(","))
        if set(parts) - {"k", "v"}:
            raise ModelError(f"KV cache spec {spec!r}: use 'q8_0' or 'k=q8_0,v=q4_0'")
        k, v = parts.get("k", "f32"), parts.get("v", "f32")
    else:
        k = v = spec
    for t in (k, v):
        if t not in CACHE_TYPES:
            raise ModelError(f"unknown KV cache type {t!r}; choose one of {', '.join(CACHE_TYPES)}")
    return k, v


class KVCache:
    """Per-layer K and V stores of one batch (``[B, Hkv, S, row]`` each) on the model's backend, and how many
    tokens each sequence holds: ``lens`` on the host, and on a device a device copy that the step itself
    advances (``advance``), so a recorded decode step needs nothing from the host but the token ids."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 kv_types: tuple[str, str] = ("f32", "f32"), backend="numba", shared_v: bool = False,
                 rotate_k: bool = False):
        from .runtime import Runtime

        rt = backend if isinstance(backend, Runtime) else Runtime(backend)
        self.rt = rt
        # rotate_k: keys are stored (and queries read) rotated by the orthonormal Hadamard matrix of the head dim:
        # q . k is unchanged, but each key's block of 32 spreads its outliers before q8_0 / q4_0 quantization
        self.rotation = None
        self._rotate_token = None
        if rotate_k:
            from .linear import Linear

            if shared_v or head_dim & (head_dim - 1):
                raise ModelError(f"a rotated key cache needs GQA rows with a power-of-two head dim (got {head_dim}"
                                 f"{', MLA latent rows' if shared_v else ''})")
            self.rotation = Linear(hadamard(head_dim), rt=rt)  # [hd, hd], symmetric: x @ H.T = x @ H
            if rt.caps.compiled_decode:  # one token per sequence: the compiled decode step's own loop (the same bits)
                from ..cpu import api as cpu

                self._rotate_token = cpu.kv_rotate
        self.max_len = int(max_len)
        self.k_fmt, self.v_fmt = (get_format(t) for t in parse_kv_cache(tuple(kv_types)))
        stores = []
        self.shared_v = shared_v  # one store read as keys and values (MLA's latent rows): V is never written
        for fmt in (self.k_fmt,) if shared_v else (self.k_fmt, self.v_fmt):
            if fmt.group_size and head_dim % fmt.group_size:
                raise ModelError(f"KV cache type {fmt.name!r} needs a head dim divisible by {fmt.group_size}; "
                                 f"this model's head dim is {head_dim}")
            (spec,) = fmt.arrays((1, head_dim)).values()  # one row: [1, row]
            stores.append([rt.zeros((batch, n_kv_heads, self.max_len, spec.shape[-1]), spec.dtype) for _ in range(n_layers)])
        self.k, self.v = (stores[0], stores[0]) if shared_v else stores  # per layer [B, Hkv, S, row]
        if shared_v:
            self.v_fmt = self.k_fmt
        self.lens = np.zeros(batch, np.int64)  # [B] on the host
        self._lens_dev = rt.zeros(batch, np.int32) if rt.on_device else None  # [B] on the device
        self._store = rt.op("kv_store")
        self._attend = rt.op("kv_attention")

    def advance(self, lengths: np.ndarray, T: int):
        """Positions ``[B, T]`` of the next ``T`` tokens (``lengths [B]`` of them valid); counts them."""
        lengths = np.asarray(lengths, np.int64)
        if self.rt.on_device:
            ones = np.ones(len(lengths), np.int64)
            lens = self.rt.const(("ones", len(lengths)), lambda: ones.astype(np.int32)) if np.array_equal(lengths, ones) \
                else self.rt.ids(lengths)
            positions = self.rt.op("positions")(self._lens_dev, lens, T)
        else:
            positions = self.lens[:, None] + np.arange(T)[None, :]
        self.lens += lengths  # in place: a view's count is its cache's (``view``)
        return positions

    # ---- slots: the sequences of a server's running batch (toolkit/serve/engine.py) --------------------------
    def view(self, lo: int, hi: int) -> "KVCache":
        """Sequences ``lo .. hi-1`` of this cache as a cache of ``hi - lo`` sequences: the same stores and counts
        (views, no copy), so what a forward pass writes and counts through the view is this cache's."""
        if not 0 <= lo <= hi <= len(self.lens):
            raise ModelError(f"cache view [{lo}, {hi}) outside the cache's {len(self.lens)} sequences")
        v = object.__new__(KVCache)
        v.__dict__.update(self.__dict__)
        v.k = [a[lo:hi] for a in self.k]  # [hi-lo, Hkv, S, row] each
        v.v = v.k if self.shared_v else [a[lo:hi] for a in self.v]
        v.lens = self.lens[lo:hi]
        v._lens_dev = self._lens_dev[lo:hi] if self._lens_dev is not None else None
        return v

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Copy sequence ``src`` into slot ``dst`` for each ``(src, dst)`` in order (the tokens it holds, its count);
        ``src``'s slot is then free. On a device the rows move on the device; the counts are copied in once."""
        for src, dst in moves:
            n = int(self.lens[src])
            for a in self._stores:
                a[dst, :, :n] = a[src, :, :n]
            self.lens[dst] = n
        if moves:
            self._sync_lens()

    def reset(self, lo: int, hi: int) -> None:
        """Empty slots ``lo .. hi-1`` (a new sequence starts there)."""
        self.lens[lo:hi] = 0
        self._sync_lens()

    def _sync_lens(self) -> None:
        if self._lens_dev is not None:
            self.rt.device.copy_in(self._lens_dev, self.lens.astype(np.int32))

    def _rotate(self, x):  # [B, T, heads, hd] -> the same rotated by H
        rows = x.reshape(-1, x.shape[-1])  # [B*T*heads, hd]
        if self._rotate_token is not None and x.shape[1] == 1:
            out = np.empty(rows.shape, np.float32)
            self._rotate_token(np.ascontiguousarray(rows, np.float32), self.rotation.weight, out)
            return out.reshape(x.shape)
        return self.rotation(rows).reshape(x.shape)

    def write(self, layer: int, k, v, positions) -> None:
        """k, v [B, T, Hkv, hd] at positions [B, T], encoded into the stores (k rotated first with rotate_k)."""
        if self.rotation is not None:
            k = self._rotate(k)
        self._store(self.k[layer], self.k_fmt, k, positions)
        if not self.shared_v:
            self._store(self.v[layer], self.v_fmt, v, positions)

    def attention(self, layer: int, q, positions, scale: float, window: int, sinks=None):
        """q [B, T, H, hd] -> [B, T, H, hd] over this layer's stored keys and values (``sinks [H]``: gpt-oss)."""
        if self.rotation is not None:
            q = self._rotate(q)
        return self._attend(q, self.k[layer], self.v[layer], self.k_fmt, self.v_fmt, positions, scale, window, sinks)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes, all layers, K and V."""
        return sum(a.shape[1] * a[0, 0, 0].nbytes for a in self._stores)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._stores)

    @property
    def _stores(self) -> list:
        return self.k if self.shared_v else self.k + self.v


def cache_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, kv_types=("f32", "f32"),
                          shared_v: bool = False) -> int:
    k, v = (get_format(t) for t in parse_kv_cache(tuple(kv_types)))
    return n_layers * n_kv_heads * (k.nbytes((1, head_dim)) + (0 if shared_v else v.nbytes((1, head_dim))))


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two), f32 [n, n]: symmetric, H H = I."""
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)
