"""cuda kv_attention: launcher of ``cuda_src/kv_attention.cu`` (GQA causal attention over the stored cache).

``q f32 [B, T, H, hd]``, ``k_store, v_store [B, Hkv, S, row]`` in the cache formats ``k_fmt, v_fmt`` (f32,
q8_0, q4_0; any pair), ``positions int32 [B, T]``, ``scale``, ``window`` (0: none) -> ``f32 [B, T, H, hd]``
(toolkit/ref/kv_attention.py, within KV_ATT_TOL). Blocks are decoded inside the dot / axpy loops. Head dims up
to 128 (GQA) take ``kv_attention_tiled``: the heads of a KV head share tiles of 16 keys, copied raw into shared
memory a tile ahead by cp.async; MLA's 576-wide latent rows take ``kv_attention_kernel`` (a key per step). Prefill on sm_80+ takes
``kv_attention_mma`` (cuda_src/kv_attention_mma.cu: tensor cores).
Split over keys (flash-decoding): ``n_split`` chunks of the visible keys per (b, t, KV head) when the grid
would otherwise be small (decode deep in the cache), merged by ``kv_attention_combine``.
The plan depends on shapes only: ``n_split`` comes from the grid size and ``max_keys``, a host-supplied bound on
the keys any query sees (default: the capacity S; with a window, at most the window). The launcher never reads
``positions`` (a decode step does not synchronise with the host); each query's chunk is computed on the device,
so a bound that is too small or too large changes only the speed. Splits with no key of their query are empty
partials, merged correctly. Positions are validated on the host by whoever owns them (the runtime, or the get_op
entry :func:`kv_attention`, which gets them as NumPy).
"""
from __future__ import annotations

import numpy as np

from .kv_store import ROWS, row_spec
from . import kv_attention_mma as mma
from .contract import NULL, check_array, contract
from .moe_gemm_mma import tensor_cores

SOURCE = "kv_attention"
WIDE_HD = 576  # MLA's row (latent 512 + rope 64): one format for K and V, 18 blocks per lane
KERNELS = (tuple(f"kv_attention_tiled<{k}, {v}>" for k in ROWS.values() for v in ROWS.values())
           + tuple(f"kv_attention_kernel<{k}, {k}, 18>" for k in ROWS.values()) + ("kv_attention_combine",))
COMBINE_WARPS = 4
MAX_WARPS = 8  # KV_ATT_MAX_WARPS in the .cu: query heads per block
TARGET_BLOCKS = 264  # ~2 waves of 132 SMs (H100/H200)
MIN_KEYS_PER_SPLIT = 64
MAX_SPLIT = 64


def check_kv_attention(q, k_store, v_store, k_fmt, v_fmt, positions) -> None:
    op = "kv_attention"
    for name, fmt in (("k_fmt", k_fmt), ("v_fmt", v_fmt)):
        contract(op, fmt.name in ROWS, f"{name} {fmt.spec!r} has no CUDA row codec; have {', '.join(ROWS)}")
    check_array(op, "q", q, np.float32, ndim=4)
    B, T, H, hd = q.shape
    contract(op, hd % 32 == 0 and 0 < hd <= WIDE_HD, f"head dim {hd} must be a multiple of 32 in [32, {WIDE_HD}]")
    contract(op, hd <= 128 or k_fmt.name == v_fmt.name,
             f"head dim {hd} > 128 needs one cache format for K and V (MLA's latent rows), got {k_fmt.name}/{v_fmt.name}")
    check_array(op, "positions", positions, np.int32, shape=(B, T))
    for name, st, fmt in (("k_store", k_store, k_fmt), ("v_store", v_store, v_fmt)):
        dtype, row = row_spec(fmt, hd)
        check_array(op, name, st, dtype, ndim=4)
        contract(op, st.shape[0] == B and st.shape[3] == row,
                 f"{name}.shape is {tuple(st.shape)}, expected ({B}, Hkv, S, {row}) for {fmt.name} rows of hd={hd}")
    contract(op, tuple(k_store.shape[:3]) == tuple(v_store.shape[:3]),
             f"k_store {tuple(k_store.shape[:3])} and v_store {tuple(v_store.shape[:3])} differ in [B, Hkv, S]")
    Hkv = k_store.shape[1]
    contract(op, Hkv > 0 and H % Hkv == 0, f"H={H} query heads must be a multiple of Hkv={Hkv}")


def plan_split(n_groups: int, max_keys: int) -> int:
    """Key chunks per (b, t, KV head): enough blocks for ~2 waves, at least MIN_KEYS_PER_SPLIT keys each."""
    want = -(-TARGET_BLOCKS // max(1, n_groups))
    return int(max(1, min(want, -(-max_keys // MIN_KEYS_PER_SPLIT), MAX_SPLIT)))


MMA_MIN_ROWS = 16  # query rows (T * H / Hkv) per KV head from which prefill runs on tensor cores


def run_kv_attention(rt, q, k_store, v_store, k_fmt, v_fmt, positions, scale: float, window: int = 0,
                     n_split: int | None = None, max_keys: int | None = None, sinks=None, kind: str | None = None):
    """``max_keys``: bound on the keys visible to any query (default: the store's capacity S), for planning
    ``n_split`` (None: planned; an int forces it). ``kind``: 'mma' (prefill on tensor cores: f16 products, hd <=
    128, no split), 'tiled' / 'kernel' (f32, key split), or None: 'mma' on an sm_80+ device when T * H / Hkv >=
    MMA_MIN_ROWS (and MOQE_CUDA_TENSOR_CORES is not 0), else the f32 kernels."""
    check_kv_attention(q, k_store, v_store, k_fmt, v_fmt, positions)
    B, T, H, hd = q.shape
    if sinks is not None:
        check_array("kv_attention", "sinks", sinks, np.float32, shape=(H,))
    sink_ptr = NULL if sinks is None else sinks
    Hkv, S = k_store.shape[1:3]
    out = rt.xp.empty((B, T, H, hd), np.float32)  # [B, T, H, hd]
    if not q.size:
        return out
    rep = H // Hkv
    if kind is None and tensor_cores(rt) and hd <= 128 and T * rep >= MMA_MIN_ROWS and n_split is None:
        kind = "mma"
    if kind == "mma":
        contract("kv_attention", hd <= 128 and n_split in (None, 1), f"the MMA kernel takes hd <= 128 (got {hd}) and no key split")
        rt.launch(mma.SOURCE, f"kv_attention_mma<{ROWS[k_fmt.name]}, {ROWS[v_fmt.name]}>",
                  (-(-T * rep // mma.ROWS_PER_BLOCK), B * Hkv), (mma.THREADS,),
                  (q, k_store, v_store, positions, sink_ptr, out, np.int32(B), np.int32(T), np.int32(H),
                           np.int32(Hkv), np.int32(S), np.int32(hd), np.float32(scale), np.int32(window)))
        return out
    bound = int(S) if max_keys is None else int(max_keys)
    contract("kv_attention", bound >= 1, f"max_keys={max_keys} must be >= 1")
    bound = min(bound, int(S), int(window)) if window > 0 else min(bound, int(S))
    split = plan_split(B * T * Hkv, max(1, bound)) if n_split is None else int(n_split)
    contract("kv_attention", split >= 1, f"n_split={split} must be >= 1")
    ws_ml = ws_acc = NULL
    if split > 1:
        ws_ml = rt.xp.empty((B * T * H, split, 2), np.float32)
        ws_acc = rt.xp.empty((B * T * H, split, hd), np.float32)
    warps = min(rep, MAX_WARPS)
    kernel = (f"kv_attention_tiled<{ROWS[k_fmt.name]}, {ROWS[v_fmt.name]}>" if hd <= 128  # GQA: key tiles
              else f"kv_attention_kernel<{ROWS[k_fmt.name]}, {ROWS[v_fmt.name]}, 18>")  # MLA's 576-wide rows
    rt.launch(SOURCE, kernel,
              (B * T * Hkv, split, -(-rep // warps)), (32 * warps,), (q, k_store, v_store, positions, sink_ptr, out, ws_ml, ws_acc, np.int32(B), np.int32(T),
                                   np.int32(H), np.int32(Hkv), np.int32(S), np.int32(hd), np.float32(scale),
                                   np.int32(window), np.int32(split)))
    if split > 1:
        heads = B * T * H
        rt.launch(SOURCE, "kv_attention_combine", (-(-heads // COMBINE_WARPS),), (32 * COMBINE_WARPS,),
                  (ws_ml, ws_acc, sink_ptr, out, np.int32(heads), np.int32(H), np.int32(hd), np.int32(split)))
    return out

