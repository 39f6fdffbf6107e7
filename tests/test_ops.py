"""Every op on every backend against its NumPy reference, over shape tables (tolerances declared per op): norms,
rope, activations, the glue between stages, and the op table itself. One test per op, run on numba (its serial and
its parallel builds), on cuda-emu (the CUDA kernels emulated on the CPU) and on cuda when a GPU is present
(tests/ops_harness.py); an op a backend does not implement (``toolkit.ops.supports_op``) is skipped with that
reason. The other op families: tests/test_ops_moe.py (routers, the MoE pipeline's stages, quantized experts,
qlinear, igemm) and tests/test_ops_kv.py (attention, the KV cache, MLA, the decode step's bookkeeping)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close, dot_tol
from ops_harness import F32_TOL, RNG, backend, both, normal, on_backend  # noqa: F401 - backend, both: fixtures
from toolkit.backend import DEVICE_BACKENDS
from toolkit.formats import QTensor, get_format
from toolkit.ops import get_op, supports_op

# [T, D]
NORM_SHAPES = [(1, 8), (5, 256), (33, 4096)]


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(both, shape):
    ref, fast = both("rms_norm")
    x = RNG.standard_normal(shape).astype(np.float32) * 3
    w = RNG.standard_normal(shape[-1]).astype(np.float32)
    assert_close(fast(x, w, 1e-5), ref(x, w, 1e-5), **F32_TOL)


# (B, T, H, hd): one token one head hd 2 and 8, odd head count and hd 6, prefill, decode at Mixtral's 32 x 128,
# the widest hd
ROPE_SHAPES = [(1, 1, 1, 2), (1, 1, 1, 8), (2, 3, 5, 6), (2, 7, 4, 32), (1, 7, 4, 64), (1, 3, 5, 128), (2, 1, 32, 128),
               (1, 2, 3, 512)]
# (hd, rd): GLM-4.5's partial rotary, inv_freq of rd/2 frequencies rotates the first rd dims, the rest pass through
ROPE_PARTIAL = [(8, 4), (24, 8), (32, 16), (64, 48), (128, 64)]
ROPE_REL = 1e-6  # |err| <= ROPE_REL * max|x| * scale (measured: 1.4e-7, positions up to 1e5; GPU sincosf: 2 ulp)


def rope_case(B, T, H, hd, rd, base):
    x = RNG.standard_normal((B, T, H, hd)).astype(np.float32)
    pos = RNG.integers(0, 100_000, (B, T))  # large angles: f32 products, then sincosf
    pos[0, 0] = 0
    return x, pos, (1.0 / base ** (np.arange(0, rd, 2) / rd)).astype(np.float32)  # inv_freq [rd/2]


@pytest.mark.parametrize("B,T,H,hd", ROPE_SHAPES)
@pytest.mark.parametrize("scale", [1.0, 0.8, 1.2])
def test_rope(both, B, T, H, hd, scale):
    ref, fast = both("rope")
    x, pos, inv = rope_case(B, T, H, hd, hd, 1e6)
    assert_close(fast(x.copy(), pos, inv, scale), ref(x, pos, inv, scale), atol=ROPE_REL * float(np.abs(x).max()) * scale)


@pytest.mark.parametrize("hd,rd", ROPE_PARTIAL)
@pytest.mark.parametrize("scale", [1.0, 1.2])
def test_rope_partial_rotary(both, hd, rd, scale):
    ref, fast = both("rope")
    x, pos, inv = rope_case(2, 3, 4, hd, rd, 1e4)
    want = ref(x, pos, inv, scale)
    assert_close(want[..., rd:], x[..., rd:], exact=True, what="dims past rd (reference)")
    got = fast(x.copy(), pos, inv, scale)
    assert_close(got[..., rd:], x[..., rd:], exact=True, what="dims past rd")
    assert_close(got, want, atol=ROPE_REL * float(np.abs(x).max()) * scale, what="partial")


@pytest.mark.parametrize("T,I2", [(1, 16), (14, 600), (9, 2 * 2880)])
def test_clamped_swiglu(both, T, I2):
    ref, fast = both("clamped_swiglu")
    x = (RNG.standard_normal((T, I2)) * 6).astype(np.float32)  # values past the limit 7 on both sides
    assert_close(fast(x, 1.702, 7.0), ref(x, 1.702, 7.0), **F32_TOL)
    g = np.array([[8.0, 0.5, -9.0, 3.0]], np.float32)  # gates (8, 0.5), ups (-9, 3): gate 8 clamps to 7, up -9 clamps to -7: (1 - 7) * 7 * sig(7*1.702)
    assert_close(ref(g, 1.702, 7.0), np.array([[-6 * 7 / (1 + np.exp(-7 * 1.702)), 4 * 0.5 / (1 + np.exp(-0.851))]], np.float32),
                 atol=1e-5)


@pytest.mark.parametrize("T,I2", [(1, 16), (9, 2000), (3, 2050), (9, 2 * 14336)])
def test_silu_and_mul(both, T, I2):
    ref, fast = both("silu_and_mul")
    x = RNG.standard_normal((T, I2)).astype(np.float32) * 4
    assert_close(fast(x), ref(x), **F32_TOL)


# ---- the glue between stages (toolkit/cpu/<op>.py: NumPy one-liners with the CPU's in-place contract) ---------
def _f16_table(V, D):
    return get_format("f16").quantize(RNG.standard_normal((V, D)).astype(np.float32), "numpy")



# (op, args maker, tolerance): each case's inputs are fresh arrays (the CPU ops may write their first argument)
GLUE = [
    ("add", lambda: (RNG.standard_normal((5, 64)).astype(np.float32), RNG.standard_normal((5, 64)).astype(np.float32)), {}),
    ("bias_add", lambda: (RNG.standard_normal((3, 40)).astype(np.float32), RNG.standard_normal(40).astype(np.float32)), {}),
    ("clip", lambda: (RNG.standard_normal((4, 33)).astype(np.float32) * 9, 2.5), {}),
    ("gated_add", lambda: (RNG.standard_normal((6, 32)).astype(np.float32), None, RNG.standard_normal((6, 32)).astype(np.float32),
                           RNG.standard_normal((6, 1)).astype(np.float32) * 4), F32_TOL),
    ("gated_add", lambda: (RNG.standard_normal((2, 8)).astype(np.float32), RNG.standard_normal((2, 8)).astype(np.float32),
                           RNG.standard_normal((2, 8)).astype(np.float32), RNG.standard_normal(2).astype(np.float32)), F32_TOL),
    ("gather_rows", lambda: (RNG.standard_normal((9, 16)).astype(np.float32), np.array([8, 0, 3], np.int64)), {}),
    ("gather_rows", lambda: (RNG.standard_normal((4, 16)).astype(np.float32), np.array([3, -1, 4, 0], np.int64)), {}),  # zeros
    ("embedding", lambda: (np.array([5, 0, 2, 2], np.int64), RNG.standard_normal((7, 24)).astype(np.float32)), {}),
    ("embedding", lambda: (np.array([1, 6, 9], np.int64), _f16_table(7, 24)), {}),  # 16-bit table; 9: a zero row
    ("linear", lambda: (RNG.standard_normal((1, 256)).astype(np.float32), RNG.standard_normal((40, 256)).astype(np.float32), None), dot_tol(256)),
    ("linear", lambda: (RNG.standard_normal((1, 4096)).astype(np.float32), RNG.standard_normal((1100, 4096)).astype(np.float32),
                        RNG.standard_normal(1100).astype(np.float32)), dot_tol(4096)),  # threaded GEMV
    ("linear", lambda: (RNG.standard_normal((7, 128)).astype(np.float32), RNG.standard_normal((33, 128)).astype(np.float32),
                        RNG.standard_normal(33).astype(np.float32)), dot_tol(128)),  # a few rows: grouped GEMV, N % 4 = 1
    ("linear", lambda: (RNG.standard_normal((16, 520)).astype(np.float32), RNG.standard_normal((2056, 520)).astype(np.float32),
                        None), dot_tol(520)),  # grouped GEMV past the parallel threshold
    ("linear", lambda: (RNG.standard_normal((17, 64)).astype(np.float32), RNG.standard_normal((30, 64)).astype(np.float32),
                        None), dot_tol(64)),  # BLAS
]


def _ids(n: int, V: int) -> np.ndarray:
    """n ids in [0, V), two of them out of range when n > 2 (-1 and V: a row of zeros, nothing read)."""
    ids = RNG.integers(0, V, n).astype(np.int64)
    if n > 2:
        ids[1], ids[2] = -1, V
    return ids


def _gated(R, C, parts):
    h, y, s = normal(R, C), normal(R, C), normal(R, C)
    g = normal(*((R, 1) if parts == "s" else (R,)), scale=4)  # [R], or the gate's [R, 1]
    return h, (y if "y" in parts else None), (s if "s" in parts else None), (g if "s" in parts else None)


GATED_REL = 1e-6  # |err| <= GATED_REL * max(|h| + |y| + |s|): expf / exp in f64 against NumPy's f32 exp (2 ulp)


def _gated_tol(args):
    h, y, s, _ = args
    return dict(atol=GATED_REL * float((np.abs(h) + (0 if y is None else np.abs(y)) + (0 if s is None else np.abs(s))).max()))


# real and edge shapes of the CUDA kernels' own tests: odd sizes, one element, rows at D 4096, 3-D inputs
GLUE += [("embedding", lambda N=N, V=V, D=D: (_ids(N, V), normal(V, D)), {})
         for N, V, D in [(1, 10, 8), (7, 33, 13), (5, 100, 64), (3, 4096, 4096)]]
GLUE += [("gather_rows", lambda R=R, C=C, n=n: (normal(R, C), _ids(n, R)), {})
         for R, C, n in [(1, 4, 1), (9, 13, 4), (12, 4096, 3)]]
ADD_SHAPES = [(1,), (7, 13), (3, 4096), (2, 5, 333)]  # one value, odd, not a multiple of a block, 3-D
GLUE += [("add", lambda sh=sh: (normal(*sh), normal(*sh)), {}) for sh in ADD_SHAPES]
GLUE += [("add_rows", lambda R=R, C=C, rows=rows: (normal(R, C), normal(len(rows), C), np.array(rows, np.int64)), {})
         for R, C, rows in [(1, 4, [0]), (9, 13, [8, 0, 3]), (5, 4096, [4, 2]), (4, 7, [3, -1, 4, 0]), (3, 8, [])]]
GLUE += [("clip", lambda sh=sh, c=c: (normal(*sh, scale=2), c), {}) for sh in ADD_SHAPES for c in (0.5, 3.0)]
GLUE += [("bias_add", lambda R=R, C=C: (normal(R, C), normal(C)), {}) for R, C in [(1, 1), (3, 7), (5, 4096)]]
GLUE += [("gated_add", lambda R=R, C=C, p=p: _gated(R, C, p), _gated_tol)
         for R, C in [(1, 8), (3, 33), (4, 4096)] for p in ("y+s", "y", "s", "none")]


@pytest.mark.parametrize("name,make,tol", GLUE, ids=[f"{g[0]}-{i}" for i, g in enumerate(GLUE)])
def test_glue_op(both, backend, name, make, tol):
    ref, fast = both(name)
    args = make()
    if backend in DEVICE_BACKENDS and any(isinstance(a, QTensor) for a in args):
        pytest.skip("a 16-bit table is a CPU layout (Runtime.stored_precision keeps f32 on a device)")
    copy = lambda a: a.copy() if isinstance(a, np.ndarray) else a  # noqa: E731
    want = ref(*(copy(a) for a in args))
    got = fast(*(copy(a) for a in args))
    assert got.dtype == np.float32 and got.shape == want.shape
    tol = tol(args) if callable(tol) else tol
    if tol:
        assert_close(got, want, **tol)
    else:
        np.testing.assert_array_equal(got, want)  # the same f32 operation: exact


@pytest.mark.parametrize("name,where", [("sample", "numba"), ("igemm", "cuda-emu"), ("attention", "cuda-emu")])
def test_an_op_a_backend_lacks_is_a_clear_error(name, where):
    from toolkit.errors import BackendError


    assert not supports_op(name, where)
    with pytest.raises(BackendError, match=f"op '{name}' is not implemented on backend '{where}'; it runs on: numpy"):
        get_op(name, where)


def test_the_op_list_is_the_reference():
    """Every module of toolkit/ref defining its stem is an op, and only those; numpy implements each."""
    from pathlib import Path

    import toolkit.ref
    from toolkit.ops import OPS

    stems = sorted(p.stem for p in Path(toolkit.ref.__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    defined = [s for s in stems if callable(getattr(__import__(f"toolkit.ref.{s}", fromlist=[s]), s, None))]
    assert list(OPS) == defined and all(supports_op(o, "numpy") for o in OPS)


def test_the_emulated_device_runs_the_thread_order_asked_for(monkeypatch):
    """MOQE_EMU_REVERSE reaches the emulator at each launch (the reverse-order backend above is not forward twice)."""
    from toolkit.gpu import emulate

    orders, real = [], emulate.Module.launch

    def launch(self, kernel, grid, block, args, reverse=False):
        orders.append(reverse)
        return real(self, kernel, grid, block, args, reverse)

    monkeypatch.setattr(emulate.Module, "launch", launch)
    h, y = np.ones((2, 8), np.float32), np.ones((2, 8), np.float32)
    add = on_backend("cuda-emu", get_op("add", "cuda-emu"))
    monkeypatch.delenv("MOQE_EMU_REVERSE", raising=False)
    assert_close(add(h, y), h + y, exact=True)
    monkeypatch.setenv("MOQE_EMU_REVERSE", "1")
    assert_close(add(h, y), h + y, exact=True)
    assert orders == [False, True]
