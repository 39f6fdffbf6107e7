"""A cold ``moqe generate`` compiles on both cores: ``help_compile(model, prompt_tokens)``.

Numba compiles one kernel at a time on one thread. On an empty kernel cache a first run spends most of its
time compiling (about 80% on the bundled model), and runs its kernels in the order of the forward pass:
attention, then the experts, then the LM head. Right after the model is loaded, this forks a helper
(``toolkit/cpu/_detached.py``: a copy-on-write fork, nothing re-loaded) that runs the other end first: each
distinct layer's FFN on throwaway rows (the prompt's row count up to 64, then one row: the prefill's and the decode's
expert kernels), then the LM head, all on their serial builds (a fork must not start Numba's thread pool).
Numba saves each kernel to the disk cache, where the run's first call finds it; the two meet in the middle.
Then the helper compiles the compiled decode step of every layer, for the next runs (this run decodes on the
staged ops: ``--compiled-decode auto``), and exits. Its throwaway rows never reach the run's state: the helper
is a separate process.
"""
from __future__ import annotations

import copy

import numpy as np

ROWS_MAX = 64  # throwaway rows at most: past moe_gemm's GEMV limit, so the prefill's tiled kernels compile too,
# without a long prompt's compute in the helper


def _job(model, prompt_tokens: int):
    def job():
        from ..cpu import api as cpu
        from ..formats import QTensor

        rng = np.random.default_rng(0)
        D = model.cfg.hidden_size
        with cpu.parallel_threshold(1 << 62):  # serial builds only
            seen = set()
            for layer in model.layers:  # one layer per distinct set of FFN weight types (the kernels' choice)
                key = tuple((type(w).__name__, getattr(w, "fmt", None) and w.fmt.name, getattr(w, "dtype", None))
                            for w in (getattr(layer.ffn, "expert_weights", None) or ()) if isinstance(w, (QTensor, np.ndarray)))
                if (type(layer.ffn).__name__, key) in seen:
                    continue
                seen.add((type(layer.ffn).__name__, key))
                for T in dict.fromkeys((min(max(1, prompt_tokens), ROWS_MAX), 1)):
                    layer.ffn((rng.standard_normal((T, D)) * 0.1).astype(np.float32))  # numba: host arrays
            model.lm_head(np.zeros((1, D), np.float32))
            m = copy.copy(model)  # the compiled decode steps: recorded, never run (a parallel build would start
            m.compiled_decode, m._steps = "record", None  # the thread pool); the layers run staged, serial
            cache = m.new_cache(1, 2)
            m.forward(np.zeros((1, 1), np.int64), cache, last_only=True)
        for build, sig in m.missing_builds():  # (already filtered to builds neither compiled nor cached)
            build.compile(sig)
    return job


def help_compile(model, prompt_tokens: int) -> tuple[str, int | None]:
    """Fork the helper (numba backend only). Returns ``start_detached``'s (what happened, pid)."""
    if not model.rt.caps.compiled_decode:
        return "unsupported", None
    from ..cpu import api as cpu

    return cpu.start_detached(_job(model, prompt_tokens))
