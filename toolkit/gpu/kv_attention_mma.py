"""cuda kv_attention on tensor cores: the kernels of ``cuda_src/kv_attention_mma.cu`` (prefill attention with
mma.sync, f16 products, f32 softmax). Launched by :func:`toolkit.gpu.kv_attention.run_kv_attention` (``kind="mma"``,
or automatically on sm_80+ for T * H / Hkv >= 16); one instantiation per (K, V) cache row format."""
from __future__ import annotations

from .kv_store import ROWS

SOURCE = "kv_attention_mma"
KERNELS = tuple(f"kv_attention_mma<{k}, {v}>" for k in ROWS.values() for v in ROWS.values())
THREADS, ROWS_PER_BLOCK = 128, 64  # ATT_ROWS in the .cu: (query, head) rows of one KV head per block
