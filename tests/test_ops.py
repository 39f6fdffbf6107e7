"""Every op on every backend against its NumPy reference, over shape tables (tolerances declared per op): one test
per op, run on numba (its serial and its parallel builds), on cuda-emu (the CUDA kernels emulated on the CPU) and
on cuda when a GPU is present. An op a backend does not implement (``toolkit.ops.supports_op``) is skipped with
that reason; a new backend gets every test here by joining ``BACKENDS``."""
from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import assert_close
from test_cuda_emulated import kv_case, kv_rows  # the KV cache cases, shared with its device-only split tests
from toolkit.backend import DEVICE_BACKENDS, cuda_unavailable_reason
from toolkit.formats import FORMATS, QTensor, get_format
from toolkit.ops import get_op, supports_op

RNG = np.random.default_rng(0)
F32_TOL = dict(atol=2e-6, rtol=2e-5)  # f32 kernels that sum in a different order than NumPy

# [T, D]
NORM_SHAPES = [(1, 8), (5, 256), (33, 4096)]
# (B, T, H, Hkv, hd, S, start): 1 token decode, prefill, GQA 4:1, MHA, odd head count, mid-cache start
ATTN_SHAPES = [(1, 1, 4, 1, 32, 16, 7), (2, 9, 8, 2, 16, 32, 0), (1, 6, 3, 3, 8, 12, 5), (3, 1, 6, 2, 64, 40, 39)]
WINDOWS = [0, 4]
# (T, E, A): one token, top-k = E, top-1, Mixtral's 8/2
ROUTER_SHAPES = [(1, 8, 2), (7, 4, 4), (16, 8, 1), (64, 8, 2), (5, 60, 4), (3, 256, 8)]  # + DeepSeek-size 256/8
# (T, E, A, D, I): one token, top-k = E, experts with no token, all to one expert (T=1, A=1)
MOE_SHAPES = [(1, 8, 2, 32, 48), (6, 4, 4, 16, 24), (3, 16, 2, 32, 32), (1, 4, 1, 64, 32), (40, 8, 2, 64, 96)]

# (backend, variant): numba's serial and parallel build of every kernel (toolkit/cpu/_jit.py); the emulated CUDA
# kernels with each block's threads in forward and in reverse order (MOQE_EMU_REVERSE)
BACKENDS = [("numba", "serial"), ("numba", "parallel"), ("cuda-emu", None), ("cuda-emu", "reverse"), ("cuda", None)]


@pytest.fixture(params=BACKENDS, ids=[b if k is None else f"{b}-{k}" for b, k in BACKENDS])
def backend(request, monkeypatch):
    name, build = request.param
    if name == "cuda" and cuda_unavailable_reason() is not None:
        pytest.skip(cuda_unavailable_reason())
    if build == "reverse":
        monkeypatch.setenv("MOQE_EMU_REVERSE", "1")
    elif build is not None:
        import toolkit.cpu._jit as jit

        monkeypatch.setattr(jit, "PARALLEL_MIN_WORK", 1 << 62 if build == "serial" else 0)
    return name


def on_backend(name: str, fn, writes: tuple[int, ...] = ()):
    """``fn`` (an op of backend ``name``) called with NumPy inputs and returning NumPy outputs: on a device the
    arrays go up first (64-bit integers as the int32 the device ops take, a QTensor's arrays, the arrays in a
    tuple) and the results come back; the op itself must not read anything back (a decode step never waits on
    the host), and the emulated device's fresh buffers hold garbage (an output left partly unwritten shows).
    ``writes``: the positions of the arguments the op updates in place (a KV cache, the seen marks); the call
    then returns ``(result, *those arguments after the op)``."""
    if name not in DEVICE_BACKENDS:
        if not writes:
            return fn
        return lambda *args: (fn(*args), *(args[i] for i in writes))
    from toolkit.gpu.api import ops_for, upload_qtensor

    dev = ops_for(name).dev

    def call(*args):
        ins = [up(a) for a in args]
        before = dev.counters.snapshot()
        out = fn(*ins)
        read = dev.counters.since(before)
        assert read.bytes_out == 0 and read.syncs == 0, "the op read a device array back to the host"
        return (down(out), *(down(ins[i]) for i in writes)) if writes else down(out)

    def up(a):
        if isinstance(a, QTensor):
            return upload_qtensor(dev, a)
        if isinstance(a, tuple):
            return tuple(up(x) for x in a)
        if isinstance(a, np.ndarray):
            return dev.to_device(np.ascontiguousarray(a, np.int32 if a.dtype.kind in "iu" and a.itemsize == 8 else a.dtype))
        return a

    def down(a):
        if isinstance(a, tuple):
            return tuple(down(x) for x in a)
        return a if a is None or isinstance(a, (np.ndarray, int, float)) else dev.to_host(a)

    return call


@pytest.fixture
def both(backend):
    """``both(op)`` -> (the NumPy reference, the op on this test's backend)."""
    def get(name, writes=()):
        if not supports_op(name, backend):
            pytest.skip(f"{name} is not an op of {backend} (toolkit.ops.supports_op)")
        return get_op(name, "numpy"), on_backend(backend, get_op(name, backend), writes)

    return get


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


@pytest.mark.parametrize("shape", ATTN_SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_attention(both, shape, window):
    ref, fast = both("attention")
    B, T, H, Hkv, hd, S, start = shape
    q = RNG.standard_normal((B, T, H, hd)).astype(np.float32)
    k = RNG.standard_normal((B, Hkv, S, hd)).astype(np.float32)
    v = RNG.standard_normal((B, Hkv, S, hd)).astype(np.float32)
    pos = np.minimum(start + np.arange(T)[None, :] + np.arange(B)[:, None], S - 1)
    assert_close(fast(q, k, v, pos, hd**-0.5, window), ref(q, k, v, pos, hd**-0.5, window), **F32_TOL)


@pytest.mark.parametrize("shape", ROUTER_SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax(both, shape, renormalize):
    ref, fast = both("topk_softmax")
    T, E, A = shape
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    wr, ir = ref(logits, A, renormalize)
    wf, idf = fast(logits, A, renormalize)
    assert_close(idf, ir, exact=True, what="expert ids")
    assert_close(wf, wr, **F32_TOL, what="routing weights")


def test_topk_softmax_ties_pick_lower_id(both):
    _, fast = both("topk_softmax")
    w, ids = fast(np.array([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0] * 5], np.float32), 2, True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert_close(w, np.full((2, 2), 0.5, np.float32), atol=1e-7)


# grouped routers: (T, E, A, n_group, topk_group); n_group 1 is plain top-k, topk_group = n_group keeps all groups
GROUPED_ROUTER_SHAPES = [(1, 8, 2, 1, 1), (7, 8, 2, 4, 2), (16, 16, 3, 4, 1), (5, 64, 6, 8, 3), (3, 256, 8, 8, 4),
                         (4, 6, 6, 2, 2), (9, 60, 4, 1, 1)]


@pytest.mark.parametrize("shape", GROUPED_ROUTER_SHAPES)
@pytest.mark.parametrize("name", ["topk_sigmoid", "topk_softmax_grouped"])
def test_grouped_routers(both, name, shape):
    """DeepSeek-V3's sigmoid router with a selection bias and V2's softmax one, both group-limited."""
    ref, fast = both(name)
    T, E, A, G, TG = shape
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    args = (A, G, TG, True, 2.5) if name == "topk_sigmoid" else (A, G, TG, 1.5)
    bias = (RNG.standard_normal(E) * 0.2).astype(np.float32)
    (wr, ir), (wf, idf) = [f(logits, bias, *args) if name == "topk_sigmoid" else f(logits, *args) for f in (ref, fast)]
    assert_close(idf, ir, exact=True, what="expert ids")
    assert_close(wf, wr, **F32_TOL, what="routing weights")
    n = E // G  # every chosen expert lies in one of the topk_group best groups
    assert len({int(i) // n for i in ir[0]}) <= TG


@pytest.mark.parametrize("where", ["numpy", "numba"])
def test_grouped_router_rules(where):
    """The group rule by hand: V3 ranks groups by the sum of their two best (biased) scores, V2 by their best;
    the bias steers the choice but the weights are the unbiased sigmoids; ties go to the lower id."""
    sig = get_op("topk_sigmoid", where)
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    x = logit(np.array([[0.9, 0.1, 0.6, 0.6, 0.2, 0.2]], np.float32)).astype(np.float32)  # groups of 2
    w, ids = sig(x, None, 2, 3, 1, False, 1.0)  # group sums 1.0, 1.2, 0.4: the middle group wins
    assert ids.tolist() == [[2, 3]]
    assert_close(w, np.array([[0.6, 0.6]], np.float32), atol=1e-6)
    bias = np.array([0, 0, 0, 0, 0.5, 0.5], np.float32)  # now group 2 leads (1.4) and its experts are chosen
    w, ids = sig(x, bias, 2, 3, 1, True, 2.0)
    assert ids.tolist() == [[4, 5]]
    assert_close(w, np.array([[1.0, 1.0]], np.float32), atol=1e-6)  # renormalised sigmoids 0.5 each, times 2
    soft = get_op("topk_softmax_grouped", where)
    p = np.array([[0.30, 0.01, 0.20, 0.20, 0.15, 0.14]], np.float32)  # group max 0.30, 0.20, 0.15
    w, ids = soft(np.log(p), 3, 3, 2, 1.0)
    assert ids.tolist() == [[0, 2, 3]]
    assert_close(w, p[:, [0, 2, 3]], atol=1e-6)


@pytest.mark.parametrize("T,I2", [(1, 16), (14, 600), (9, 2 * 2880)])
def test_clamped_swiglu(both, T, I2):
    ref, fast = both("clamped_swiglu")
    x = (RNG.standard_normal((T, I2)) * 6).astype(np.float32)  # values past the limit 7 on both sides
    assert_close(fast(x, 1.702, 7.0), ref(x, 1.702, 7.0), **F32_TOL)
    g = np.array([[8.0, 0.5, -9.0, 3.0]], np.float32)  # gates (8, 0.5), ups (-9, 3): gate 8 clamps to 7, up -9 clamps to -7: (1 - 7) * 7 * sig(7*1.702)
    assert_close(ref(g, 1.702, 7.0), np.array([[-6 * 7 / (1 + np.exp(-7 * 1.702)), 4 * 0.5 / (1 + np.exp(-0.851))]], np.float32),
                 atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_moe_bias_add(both, weighted):
    ref, fast = both("moe_bias_add")
    T, A, E, N = 5, 3, 7, 33
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    w = RNG.random((T, A)).astype(np.float32) if weighted else None
    y, b = RNG.standard_normal((T * A, N)).astype(np.float32), RNG.standard_normal((E, N)).astype(np.float32)
    want = ref(y.copy(), b, ids, w)
    assert_close(want[4], y[4] + (w[1, 1] if weighted else 1) * b[ids[1, 1]], atol=1e-6)  # row t*A + a
    assert_close(fast(y.copy(), b, ids, w), want, **F32_TOL)


@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_attention_sinks(both, shape):
    """A sink adds exp(sink) to each head's softmax denominator (gpt-oss): checked against the formula too."""
    ref, fast = both("attention")
    B, T, H, Hkv, hd, S, start = shape
    q = RNG.standard_normal((B, T, H, hd)).astype(np.float32)
    k = RNG.standard_normal((B, Hkv, S, hd)).astype(np.float32)
    v = RNG.standard_normal((B, Hkv, S, hd)).astype(np.float32)
    pos = np.minimum(start + np.arange(T)[None, :] + np.arange(B)[:, None], S - 1)
    sinks = (RNG.standard_normal(H) * 2).astype(np.float32)
    want = ref(q, k, v, pos, hd**-0.5, 0, sinks)
    assert_close(fast(q, k, v, pos, hd**-0.5, 0, sinks), want, **F32_TOL)
    p, h = int(pos[-1, -1]), H - 1
    s = np.append(k[-1, h // (H // Hkv), : p + 1] @ q[-1, -1, h] * hd**-0.5, sinks[h])
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    assert_close(want[-1, -1, h], w[:-1] @ v[-1, h // (H // Hkv), : p + 1], atol=1e-5)


@pytest.mark.parametrize("T,I2", [(1, 16), (9, 2000), (3, 2050), (9, 2 * 14336)])
def test_silu_and_mul(both, T, I2):
    ref, fast = both("silu_and_mul")
    x = RNG.standard_normal((T, I2)).astype(np.float32) * 4
    assert_close(fast(x), ref(x), **F32_TOL)


@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_moe_experts(both, backend, shape):
    ref, fast = both("moe_experts")
    T, E, A, D, I = shape
    x = RNG.standard_normal((T, D)).astype(np.float32)
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    w = RNG.random((T, A)).astype(np.float32)
    gate_up = RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1
    down = RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1
    if backend in DEVICE_BACKENDS and (D % 32 or I % 32):  # the device GEMM reads K in blocks of 32: its contract
        from toolkit.errors import BackendError

        with pytest.raises(BackendError, match=r"moe_gemm: layout contract broken: K=\d+ must be a multiple of 32"):
            fast(x, ids, w, gate_up, down)
        return
    assert_close(fast(x, ids, w, gate_up, down), ref(x, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


# ---- the glue between stages (toolkit/cpu/<op>.py: NumPy one-liners with the CPU's in-place contract) ---------
def _f16_table(V, D):
    return get_format("f16").quantize(RNG.standard_normal((V, D)).astype(np.float32), "numpy")


def dot_tol(K: int) -> dict:
    """An f32 dot product of K unit-scale terms summed in another order (GEMV lanes, BLAS blocks): |err| grows
    with K * eps * |terms|; 4x that for the worst of a few thousand outputs."""
    return dict(atol=4.0 * K * 2.0**-23, rtol=2e-5)


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
                        RNG.standard_normal(33).astype(np.float32)), dot_tol(128)),  # BLAS
]


def _normal(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _ids(n: int, V: int) -> np.ndarray:
    """n ids in [0, V), two of them out of range when n > 2 (-1 and V: a row of zeros, nothing read)."""
    ids = RNG.integers(0, V, n).astype(np.int64)
    if n > 2:
        ids[1], ids[2] = -1, V
    return ids


def _gated(R, C, parts):
    h, y, s = _normal(R, C), _normal(R, C), _normal(R, C)
    g = _normal(*((R, 1) if parts == "s" else (R,)), scale=4)  # [R], or the gate's [R, 1]
    return h, (y if "y" in parts else None), (s if "s" in parts else None), (g if "s" in parts else None)


GATED_REL = 1e-6  # |err| <= GATED_REL * max(|h| + |y| + |s|): expf / exp in f64 against NumPy's f32 exp (2 ulp)


def _gated_tol(args):
    h, y, s, _ = args
    return dict(atol=GATED_REL * float((np.abs(h) + (0 if y is None else np.abs(y)) + (0 if s is None else np.abs(s))).max()))


# real and edge shapes of the CUDA kernels' own tests: odd sizes, one element, rows at D 4096, 3-D inputs
GLUE += [("embedding", lambda N=N, V=V, D=D: (_ids(N, V), _normal(V, D)), {})
         for N, V, D in [(1, 10, 8), (7, 33, 13), (5, 100, 64), (3, 4096, 4096)]]
GLUE += [("gather_rows", lambda R=R, C=C, n=n: (_normal(R, C), _ids(n, R)), {})
         for R, C, n in [(1, 4, 1), (9, 13, 4), (12, 4096, 3)]]
ADD_SHAPES = [(1,), (7, 13), (3, 4096), (2, 5, 333)]  # one value, odd, not a multiple of a block, 3-D
GLUE += [("add", lambda sh=sh: (_normal(*sh), _normal(*sh)), {}) for sh in ADD_SHAPES]
GLUE += [("clip", lambda sh=sh, c=c: (_normal(*sh, scale=2), c), {}) for sh in ADD_SHAPES for c in (0.5, 3.0)]
GLUE += [("bias_add", lambda R=R, C=C: (_normal(R, C), _normal(C)), {}) for R, C in [(1, 1), (3, 7), (5, 4096)]]
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


# ---- the decode step's bookkeeping: positions, sampling, nll (the device's own ops; the CPU runs them in NumPy) ----
# (B, T): decode, odd prefill, T over the block of threads
POSITION_SHAPES = [(1, 1), (3, 7), (2, 300)]
# (N, V): one row of one token, odd V, V not a multiple of the block, Mixtral's vocabulary
NLL_SHAPES = [(1, 1), (3, 33), (4, 1000), (2, 32000)]
NLL_TOL = dict(atol=2e-6, rtol=2e-6)  # f32 sums against f64 (measured: 1.2e-7 relative, one ulp, to V = 262144)
# (B, V): one token vocabulary, tiny and odd V, V not a multiple of any block, Mixtral's vocabulary
SAMPLE_SHAPES = [(6, 1), (16, 5), (16, 33), (8, 1000), (1, 32000)]
# (temperature, top_k, top_p, repetition_penalty)
SAMPLE_CASES = [
    (0.0, 0, 1.0, 1.0),  # greedy
    (0.0, 0, 1.0, 1.3),  # greedy, penalised
    (1.0, 0, 1.0, 1.0),  # plain softmax
    (0.7, 50, 0.9, 1.2),  # the usual mix
    (1.0, 1, 1.0, 1.0),  # top-k = 1: the max and its ties
    (1.0, 0, 1e-6, 1.0),  # top-p tiny: the most likely token(s)
    (1.3, 10**6, 0.5, 1.1),  # top-k >= V (off), top-p half
    (0.5, 3, 1.0, 2.0),  # top-k 3, strong penalty
]


@pytest.mark.parametrize("B,T", POSITION_SHAPES)
def test_positions(both, B, T):
    """The step's positions [B, T] and the lengths after it: the device updates ``lens`` in place (the
    reference returns the new lengths), so the test reads it back after the op. Exact."""
    ref, fast = both("positions", writes=(0,))
    lens = RNG.integers(0, 1000, B).astype(np.int32)
    lengths = RNG.integers(0, T + 1, B).astype(np.int32)
    want_pos, want_lens = ref(lens.copy(), lengths, T)
    got_pos, got_lens = fast(lens.copy(), lengths, T)
    assert_close(got_pos, want_pos, exact=True, what="positions")
    assert_close(got_lens, want_lens, exact=True, what="lens after the step")


@pytest.mark.parametrize("N,V", NLL_SHAPES)
def test_nll(both, N, V):
    ref, fast = both("nll")
    logits = (RNG.standard_normal((N, V)) * 4 + 10).astype(np.float32)  # offset: the max matters
    targets = RNG.integers(0, V, N).astype(np.int32)
    if N > 2:
        targets[2] = V  # out of range: NaN, no read
    want, got = ref(logits, targets), fast(logits, targets)
    assert_close(np.isnan(got), np.isnan(want), exact=True, what="NaN for a target out of range")
    ok = ~np.isnan(want)
    assert_close(got[ok], want[ok], **NLL_TOL, what="nll")


def sample_rows(B: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Random rows with ties: row 0 all equal, row 1 on a coarse grid (many ties), row 2 a tied maximum."""
    logits = (RNG.standard_normal((B, V)) * 3).astype(np.float32)  # [B, V]
    if B > 3:
        logits[0] = 0.5
        logits[1] = np.round(logits[1])
        logits[2, : min(V, 3)] = logits[2].max() + 1
    seen = (RNG.random((B, V)) < 0.2).astype(np.uint8)  # [B, V]
    return logits, seen


# sample's contract is the reference's algorithm (toolkit/ref/sample.py: a counter-based uniform per (seed, step,
# row), then the inverse CDF of the filtered distribution), so a fixed seed gives the reference's tokens exactly
# (a token could differ only if u fell within f32 rounding of a boundary); the op also marks each drawn token in
# ``seen`` (argument 7) in place, which the test reads back after the op.
@pytest.mark.parametrize("B,V", SAMPLE_SHAPES)
@pytest.mark.parametrize("case", SAMPLE_CASES, ids=lambda c: "t{}-k{}-p{}-r{}".format(*c))
def test_sample(both, B, V, case):
    ref, fast = both("sample", writes=(7,))
    logits, seen = sample_rows(B, V)
    want_seen = seen.copy()
    steps = 2 if B * V < 10_000 else 1  # the second step is penalised by the first one's marks
    for step in range(steps):
        want = ref(logits, *case, 123, step, want_seen)
        scratch = (np.empty((B, V), np.float32),) if step else ()  # the caller's scratch on the second step
        got, seen = fast(logits, *case, np.uint64(123), step, seen, *scratch)
        assert_close(got, want, exact=True, what=f"tokens, step {step}")
        assert_close(seen, want_seen, exact=True, what=f"seen after step {step}")


def test_sample_steps_per_row(both):
    """step as an int32 [B] array (e.g. the cache lengths): row b draws with step[b], and the same call with new
    values in step draws new tokens (a recorded decode step replayed)."""
    ref, fast = both("sample")
    B, V = 16, 40
    logits = np.tile(RNG.standard_normal(V).astype(np.float32), (B, 1))  # [B, V] one distribution
    seen = np.zeros((B, V), np.uint8)
    steps = RNG.integers(0, 10_000, B).astype(np.int32)
    draws = []
    for _ in range(2):
        want = ref(logits, 1.0, 0, 1.0, 1.0, 7, steps, seen.copy())
        draws.append(fast(logits, 1.0, 0, 1.0, 1.0, 7, steps, seen.copy()))
        assert_close(draws[-1], want, exact=True, what="tokens")
        steps += 1
    assert not np.array_equal(*draws)


def test_sample_greedy_is_argmax(both):
    """temperature 0 is np.argmax of the penalised logits: the first of tied maxima, the first NaN, all -inf."""
    from toolkit.ref.sample import penalised

    _, fast = both("sample")
    logits, seen = sample_rows(6, 300)
    logits[3, [7, 100]] = np.nan
    logits[4] = -np.inf
    logits[5, [250, 20]] = 1e9
    seen[5, [250, 20]] = 0
    want = np.argmax(penalised(logits, seen, 1.5), axis=1).astype(np.int32)
    assert_close(fast(logits, 0.0, 0, 1.0, 1.5, 0, 0, seen.copy()), want, exact=True)
    assert want[3] == 7 and want[4] == 0 and want[5] == 20


def test_sample_frequencies_follow_the_distribution(both):
    """2000 draws of one row (one per sequence: u depends on the row) against sample_probs, with a chi-square
    bound at p = 0.001 (Wilson-Hilferty); filtered tokens are never drawn."""
    from toolkit.ref.sample import sample_probs

    ref, fast = both("sample")
    V, n = 12, 2000
    row = np.linspace(-1, 2, V).astype(np.float32)
    row[[4, 9]] = row[9]  # a tie
    logits = np.tile(row, (n, 1))  # [n, V]
    seen = np.zeros((n, V), np.uint8)
    seen[:, [2, 11]] = 1  # penalised
    case = (0.8, 8, 1.0, 1.5)
    p = sample_probs(logits[:1], *case, seen[:1])[0]  # [V]
    got = fast(logits, *case, 2024, 5, seen.copy())
    assert_close(got, ref(logits, *case, 2024, 5, seen.copy()), exact=True)
    counts = np.bincount(got, minlength=V)
    assert counts[p == 0].sum() == 0, "a token outside top-k was drawn"
    kept = p > 0
    chi2 = float((((counts - n * p) ** 2)[kept] / (n * p[kept])).sum())
    df, z = int(kept.sum()) - 1, 3.09
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, f"chi-square {chi2:.1f} over {df} degrees of freedom exceeds {bound:.1f}"


def test_sample_reference_matches_the_cpu_sampler():
    """The spec itself: sample_probs equals toolkit/model/sampling.py's next_token_probs (f64 throughout) to f32
    rounding on rows without ties at the top-p boundary (there the spec keeps every tied token)."""
    from toolkit.model.sampling import SamplingParams, next_token_probs
    from toolkit.ref.sample import sample_probs

    logits, seen = sample_rows(5, 400)
    logits[:4] = (RNG.standard_normal((4, 400)) * 3).astype(np.float32)  # no ties
    for t, k, top_p, pen in [(0.7, 50, 0.9, 1.2), (1.0, 0, 0.5, 1.0), (1.3, 7, 1.0, 2.0)]:
        params = SamplingParams(temperature=t, top_k=k, top_p=top_p, repetition_penalty=pen)
        want = np.stack([next_token_probs(logits[b], np.flatnonzero(seen[b]), params) for b in range(4)])
        assert_close(sample_probs(logits[:4], t, k, top_p, pen, seen[:4]), want, atol=1e-6)


def test_mark_seen(both):
    """The prompt's tokens marked in ``seen`` [B, V] in place (read back after the op); ids out of range skipped."""
    ref, fast = both("mark_seen", writes=(2,))
    B, T, V = 3, 300, 50
    ids = RNG.integers(0, V, (B, T)).astype(np.int32)
    ids[0, :2] = [-1, V]  # out of range: skipped
    lengths = np.array([T, 3, 0], np.int32)
    want = np.zeros((B, V), np.uint8)
    ref(ids, lengths, want)
    _, got = fast(ids, lengths, np.zeros((B, V), np.uint8))
    assert_close(got, want, exact=True, what="seen")


# ---- the KV cache: kv_store writes block bytes in place, kv_attention reads them ------------------------
KV_FORMATS = ["f32", "q8_0", "q4_0"]
KV_PAIRS = [("f32", "f32"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("f32", "q4_0")]
# (B, T, Hkv, hd, S): decode, prefill, odd head count, hd 32 / 64 / 128
KV_STORE_SHAPES = [(1, 1, 8, 128, 40), (2, 7, 2, 64, 16), (1, 5, 3, 32, 8)]
# (B, T, H, Hkv, hd, S, start): decode T=1 deep in the cache (the device's key split), prefill from 0, GQA 4:1,
# MHA, rep 12, hd 128 (Mixtral); then splits planned from the capacity (max_keys = S) that find few keys: decode
# at position 3 and at 0 of a cache of 300 (5 splits: one key each, or a single key and 4 empty splits), a T=4
# prefill from 0 (the early queries see 1..4 keys of their 5 splits); then small caches filled to start + T + 2
KV_ATT_SHAPES = [(1, 1, 8, 2, 128, 300, 290), (2, 6, 4, 1, 64, 16, 0), (1, 3, 4, 4, 32, 40, 20),
                 (2, 1, 12, 1, 32, 200, 150), (1, 1, 8, 2, 128, 300, 3), (1, 1, 4, 1, 64, 300, 0),
                 (1, 4, 4, 1, 64, 300, 0), (1, 1, 4, 1, 32, 43, 40), (2, 7, 4, 2, 64, 9, 0), (1, 3, 8, 2, 128, 22, 17),
                 (3, 1, 6, 6, 32, 8, 5)]
KV_ATT_TOL = dict(atol=2e-5, rtol=1e-4)  # f32 softmax, another summation order and expf


# kv_store's contract is the bytes it writes into the caller's cache [B, Hkv, S, row] (argument 0, in place, read
# back after the op): compared byte for byte with the reference's, and with gguf's quantizer
@pytest.mark.parametrize("shape", KV_STORE_SHAPES)
@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_kv_store(both, shape, fmt):
    ref, fast = both("kv_store", writes=(0,))
    B, T, Hkv, hd, S = shape
    f = get_format(fmt)
    x = kv_rows(f, B, T, Hkv, hd, scale=3.0)
    positions = np.stack([RNG.permutation(S)[:T] for _ in range(B)]).astype(np.int32)  # [B, T] scattered
    (spec,) = f.arrays((1, hd)).values()
    want = np.zeros((B, Hkv, S, spec.shape[-1]), spec.dtype)  # [B, Hkv, S, row]
    _, got = fast(want.copy(), f, x, positions)
    ref(want, f, x, positions)
    assert_close(got, want, exact=True, what=f"{fmt} cache bytes")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_kv_store_matches_gguf(both, fmt):
    gguf = pytest.importorskip("gguf")
    _, fast = both("kv_store", writes=(0,))
    f = get_format(fmt)
    x = kv_rows(f, 1, 3, 2, 64, scale=5.0)
    store = np.zeros((1, 2, 5, f.arrays((1, 64))["blocks"].shape[-1]), np.uint8)
    _, store = fast(store, f, x, np.arange(3, dtype=np.int32)[None])
    qt = getattr(gguf.GGMLQuantizationType, fmt.upper())
    want = gguf.quants.quantize(x.transpose(0, 2, 1, 3).reshape(-1, 64), qt).reshape(1, 2, 3, -1)
    assert_close(store[:, :, :3], want, exact=True, what="vs gguf")
    assert not store[:, :, 3:].any()  # untouched rows stay empty


@pytest.mark.parametrize("shape", KV_ATT_SHAPES)
@pytest.mark.parametrize("kf,vf", KV_PAIRS)
@pytest.mark.parametrize("window", [0, 5])
def test_kv_attention(both, shape, kf, vf, window):
    ref, fast = both("kv_attention")
    q, ks, vs, k_fmt, v_fmt, positions, scale = kv_case(kf, vf, *shape)
    want = ref(q, ks, vs, k_fmt, v_fmt, positions, scale, window)
    assert_close(fast(q, ks, vs, k_fmt, v_fmt, positions, scale, window), want, **KV_ATT_TOL,
                 what=f"K {kf} / V {vf}, window {window}")


# ---- absorbed MLA (DeepSeek): the stages around kv_attention over the latent cache ---------------------
# (B, T, H, dn, dr, r, dv); DeepSeek-V3's head: dn 128, dr 64, r 512, dv 128
MLA_SHAPES = [(2, 3, 4, 16, 8, 24, 12), (1, 1, 3, 128, 64, 512, 128), (1, 5, 2, 32, 32, 64, 16)]
MLA_TOL = dict(atol=2e-5, rtol=2e-5)  # K-long f32 dot products (r <= 512) summed in another order


def mla_args(name, B, T, H, dn, dr, r, dv, interleave):
    pos = RNG.integers(0, 3000, (B, T)).astype(np.int32)
    inv = (1.0 / 10000 ** (np.arange(0, dr, 2) / dr)).astype(np.float32)
    if name == "mla_q":
        return _normal(B * T, H * (dn + dr)), _normal(H, dn, r, scale=0.1), pos, inv, 1.2, interleave
    if name == "mla_kv":
        return _normal(B * T, r + dr), _normal(r), 1e-6, pos, inv, 1.2, interleave
    return _normal(B, T, H, r + dr), _normal(H, r, dv, scale=0.1)  # mla_out


@pytest.mark.parametrize("shape", MLA_SHAPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("name", ["mla_q", "mla_kv", "mla_out"])
def test_mla(both, name, shape, interleave):
    if name == "mla_out" and not interleave:
        pytest.skip("mla_out has no rope (interleave does not apply)")
    ref, fast = both(name)
    args = mla_args(name, *shape, interleave)
    assert_close(fast(*args), ref(*args), **MLA_TOL, what=name)


# ---- the quantized experts: fused_moe (align -> GEMM1 -> activation -> GEMM2 -> combine) and qlinear ----
# every registry format, group-wise ones at every group size (GGML's q4_1 / q5_* and k-quants, K a multiple of
# 256, have their own tables in tests/test_kquant.py and test_cuda_emulated.py)
QUANT_SPECS = [f"{f.name}-g{g}" for f in FORMATS.values() for g in f.group_sizes] + \
              [f.name for f in FORMATS.values() if not f.group_sizes and f.kind != "ggml"]
# the formats cuda-emu runs the whole pipeline in (the emulator's cost); each CUDA decoder has its moe_gemm rows
# in tests/test_cuda_emulated.py; a GPU runs every format
EMU_SPECS = {"int4", "fp8", "q4_0"}
# (T, E, A, D, I, one_expert): one token, top-k = E, experts with no token, all tokens on expert 0, prefill-sized;
# T=20 over 8 experts (the device's block_m 16 with a few blocks per expert), 48 x 2 slots over 2 experts (the
# device's block_m 64: block_m_for)
FUSED_SHAPES = [(1, 8, 2, 128, 128, False), (6, 4, 4, 128, 256, False), (3, 16, 2, 256, 128, False),
                (12, 4, 1, 128, 128, True), (24, 4, 2, 128, 256, False), (20, 8, 2, 128, 128, False),
                (48, 2, 2, 128, 128, False)]
# gpt-oss's experts (per-expert biases on both GEMMs, the clamped SwiGLU): (T, E, A, D, I, format); f32 runs
# moe_experts, the quantized ones fused_moe
BIAS_CASES = [(T, 6, 2, 64, 96, spec) for spec in ("mxfp4", "int4-g32", "f32") for T in (1, 5, 40)] + \
             [(T, 8, 2, 128, 64, "mxfp4") for T in (1, 20)]
MOE_TOL = 2e-5  # |err| <= MOE_TOL * max|reference| + 1e-6: f32 sums over K in another order
FLIP = 0.02  # of max|reference|: one W8A8 activation code flipped through the down GEMM (measured <= 0.007)


def close_moe(actual, expected, w8a8=False, what=""):
    """Weight-only: every value within ``MOE_TOL`` of the output's scale (both sides decode the same codes to the
    same f32 values, only the summation order differs). W8A8 quantizes the intermediate (after GEMM1 and the
    activation) before GEMM2: an f32 sum in another order can put one value on the other side of an fp8 rounding
    boundary, and that token's row moves by one code step through the down GEMM (seen in ~6 of 100 random cases,
    always one row): every row within ``MOE_TOL``, but at most one row in eight within ``FLIP``. A wrong expert,
    scale or token is O(1)."""
    scale = float(np.abs(expected).max())
    if not w8a8:
        return assert_close(actual, expected, atol=MOE_TOL * scale + 1e-6, what=what)
    err = np.abs(actual - expected).max(axis=1)  # [T] worst element per token row
    off = np.nonzero(err > MOE_TOL * scale + 1e-6)[0]
    assert len(off) <= max(1, len(err) // 8) and (err[off] <= FLIP * scale).all(), \
        f"{what}: rows {off.tolist()} off by {(err[off] / scale).round(4).tolist()} of max|ref|"


def moe_routing(T, E, A, one_expert=False):
    """ids [T, A] (distinct per token; ``one_expert``: slot a -> expert a, so A=1 puts all on expert 0) and
    weights [T, A] summing to 1."""
    if one_expert:
        ids = np.zeros((T, A), np.int32) + np.arange(A, dtype=np.int32)
    else:
        ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    w = RNG.random((T, A)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def quant_case(backend, spec):
    """Skips a format cuda-emu does not run (cost); on a device, a format without a CUDA decoder is refused by
    name (moe_gemm's contract): returns False then, after checking the refusal is what ``call`` raises."""
    if backend == "cuda-emu" and get_format(spec).name not in EMU_SPECS:
        pytest.skip(f"{spec}: cuda-emu runs the experts in {sorted(EMU_SPECS)} (emulation cost)")
    return backend not in DEVICE_BACKENDS or get_format(spec).cuda_decoder is not None


def refused(call, spec):
    from toolkit.errors import BackendError

    with pytest.raises(BackendError, match=rf"moe_gemm.*format '{get_format(spec).name}' has no CUDA decoder"):
        call()


@pytest.mark.parametrize("shape", FUSED_SHAPES)
@pytest.mark.parametrize("spec", QUANT_SPECS)
def test_fused_moe(both, backend, spec, shape):
    ref, fast = both("fused_moe")
    runs = quant_case(backend, spec)
    T, E, A, D, I, one = shape
    ids, tw = moe_routing(T, E, A, one)
    f = get_format(spec)
    gate_up, down = (f.quantize(_normal(*s, scale=0.1), "numba") for s in ((E, 2 * I, D), (E, D, I)))
    x = _normal(T, D)
    if not runs:
        return refused(lambda: fast(x, tw, ids, gate_up, down), spec)
    got = fast(x, tw, ids, gate_up, down)
    w8a8 = f.act_quant is not None
    if not w8a8:  # weight-only: the dense expert MoE on the dequantized weights (the reference pipeline too)
        want = get_op("moe_experts", "numpy")(x, ids, tw, gate_up.dequantize(), down.dequantize())
        close_moe(ref(x, tw, ids, gate_up, down), want, what=f"fused_moe reference {spec}")
    else:  # W8A8: the reference pipeline (activations quantized before each GEMM)
        want = ref(x, tw, ids, gate_up, down)
    close_moe(got, want, w8a8, what=f"fused_moe {spec}")


@pytest.mark.parametrize("case", BIAS_CASES)
def test_experts_with_biases_and_clamped_swiglu(both, backend, case):
    """gpt-oss's expert part, in the grouped pipeline (quantized) and moe_experts (f32), against the dense
    reference on the same weights, token by token."""
    T, E, A, D, I, spec = case
    _, fast = both("moe_experts" if spec == "f32" else "fused_moe")
    ids, tw = moe_routing(T, E, A)
    gu, dn = _normal(E, 2 * I, D, scale=0.3), _normal(E, D, I, scale=0.3)
    bias = (_normal(E, 2 * I), _normal(E, D))
    x = _normal(T, D, scale=3)
    act = ("clamped_swiglu", 1.702, 7.0)
    if spec == "f32":
        got = fast(x, ids, tw, gu, dn, bias, act)
    else:
        quant_case(backend, spec)
        gate_up, down = (get_format(spec).quantize(w, "numba") for w in (gu, dn))
        got = fast(x, tw, ids, gate_up, down, bias, act)
        gu, dn = gate_up.dequantize(), down.dequantize()
    want = np.zeros((T, D), np.float32)  # dense, token by token
    act_ref = get_op("clamped_swiglu", "numpy")
    for t in range(T):
        for a in range(A):
            e = ids[t, a]
            h = act_ref((gu[e] @ x[t] + bias[0][e])[None], 1.702, 7.0)[0]
            want[t] += tw[t, a] * (dn[e] @ h + bias[1][e])
    close_moe(got, want, what=f"{spec} T={T}")


@pytest.mark.parametrize("T", [1, 3, 20])
@pytest.mark.parametrize("spec", QUANT_SPECS)
def test_qlinear(both, backend, spec, T):
    ref, fast = both("qlinear")
    runs = quant_case(backend, spec)
    N, K = 41, 128
    w = get_format(spec).quantize(_normal(N, K, scale=0.1), "numba")
    x = _normal(T, K)
    if not runs:
        return refused(lambda: fast(x, w), spec)
    want = ref(x, w)
    if get_format(spec).act_quant is None:
        close_moe(want, x @ w.dequantize().T, what="qlinear reference")
    close_moe(fast(x, w), want, what=f"qlinear {spec}")


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
