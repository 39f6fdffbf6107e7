"""Run emulated kernels in the ASan build; started by tests/test_cuda_emulated.py in a subprocess whose
environment preloads the ASan runtime (toolkit.gpu.emulate.asan_env()).

    python tests/cuda/asan_case.py ops   # launchers of several ops vs the NumPy reference; prints 'ok'
    python tests/cuda/asan_case.py oob   # a kernel writing one past its output: ASan must abort the process
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from toolkit.gpu import emulate  # noqa: E402
from toolkit.gpu.device import EmuDevice  # noqa: E402


def ops() -> None:
    from toolkit.formats import get_format
    from toolkit.gpu.moe_align import run_moe_align
    from toolkit.gpu.moe_gemm import run_moe_gemm
    from toolkit.gpu.topk_softmax import run_topk_softmax
    from toolkit.ref.moe_align import moe_align
    from toolkit.ref.moe_gemm import moe_gemm
    from toolkit.ref.topk_softmax import topk_softmax

    rng = np.random.default_rng(0)
    int3 = lambda k: "Dec" not in k or "AffineDec<3>, 16" in k  # noqa: E731 - int3's decoder: odd byte offsets
    rt = EmuDevice(mode="asan", reverse=False, select=int3)
    logits = rng.standard_normal((5, 40)).astype(np.float32)
    w, ids = map(rt.to_host, run_topk_softmax(rt, logits, 3, True))
    wr, ir = topk_softmax(logits, 3, True)
    assert np.array_equal(ids, ir) and np.allclose(w, wr, atol=1e-6), "topk_softmax"
    s, e, total = map(rt.to_host, run_moe_align(rt, ir, 40, 16))  # upper-bound layout: P_cap = 15 + 40 * 15 -> 39 blocks
    sr, er, Pr = moe_align(ir, 40, 16)
    P = int(total[0])
    assert P == Pr and np.array_equal(s[:P], sr) and np.array_equal(e[: P // 16], er), "moe_align"
    assert (s[P:] == ir.size).all() and (e[P // 16 :] == -1).all() and e.size == 39, "moe_align padding"
    x = rng.standard_normal((5, 64)).astype(np.float32)
    wq = get_format("int3").quantize(rng.standard_normal((40, 40, 64)).astype(np.float32) * 0.1)
    for kind in ("splitk", "tiled"):  # the -1 blocks must exit before touching the weights of expert -1
        out = rt.to_host(run_moe_gemm(rt, x, wq, s, e, 16, 3, kind=kind))
        assert np.allclose(out, moe_gemm(x, wq, sr, er, 16, 3), atol=1e-5), f"moe_gemm {kind}"
    print("ok")


def oob() -> None:
    cu = Path(__file__).with_name("barrier_demo.cu")
    y = np.zeros(8, np.float32)
    emulate.module(cu, ("oob_write",), "asan").launch("oob_write", (1,), (32,), (y, np.int32(8)))
    print("no error detected")


if __name__ == "__main__":
    {"ops": ops, "oob": oob}[sys.argv[1]]()
