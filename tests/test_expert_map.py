"""fused_moe's ``expert_map`` (vLLM's, as for expert parallelism): a mixed-width expert layer runs one fused_moe per
storage format, each over its own experts only, and sums the [T, D] outputs. Every backend (NumPy, Numba, the
emulated CUDA device) against the NumPy reference.

Tolerances: the layer sum against moe_experts on the per-expert dequantized weights within ``TOL`` of the output's
scale (f32 sums in another order); the tensor-core path within ``ROUNDING_TOL`` of it (f16 operands); layouts, a group
that receives no token (exact zeros) and the identity map (bit-identical to no map) exact.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, run_on

from toolkit.errors import BackendError
from toolkit.formats import get_format
from toolkit.gpu.device import EmuDevice
from toolkit.gpu.fused_moe import run_fused_moe
from toolkit.gpu.moe_align import run_moe_align
from toolkit.gpu.moe_gemm_mma import block_m_for
from toolkit.ops import get_op

RNG = np.random.default_rng(7)
BACKENDS = ["numpy", "numba", "cuda-emu"]
TOL = 2e-5  # |err| <= TOL * max|reference| + 1e-6
ROUNDING_TOL = 2e-3  # tensor cores, f16 operands (2^-11 each): |err| <= ROUNDING_TOL * max|reference| (seen: 6e-4)
# (T, E, A, D, I): the decode step, a few tokens, prefill-sized (> 8 rows per expert), top-k = E
SHAPES = [(1, 6, 2, 64, 64), (5, 6, 2, 64, 96), (40, 6, 2, 64, 64), (3, 6, 6, 64, 64)]
# the experts of a layer split by storage format: (format, experts) per group
GROUPS = {
    "three": [("int4-g32", [0, 3]), ("int8", [1, 4, 5]), ("q8_0", [2])],
    "two": [("q8_0", [5, 0, 2]), ("int4-g32", [1, 3, 4])],  # local order not the global one
}
# (expert ids [E_total], E_local, message): refused maps
BAD_MAPS = [
    (np.array([0, 1, 2], np.int32), 2, r"values must lie in \[-1, 2\)"),
    (np.array([0, -2, 1, -1, 0, 1], np.int32), 2, r"values must lie in \[-1, 2\)"),
    (np.array([0, 1], np.int32), 2, r"expert ids must lie in \[0, len\(expert_map\)\) = \[0, 2\)"),  # id 2
    (np.zeros((2, 3), np.int32), 2, r"non-empty 1-D integer"),
    (np.array([0.0, 1.0, -1.0, 0.0, 1.0, -1.0]), 2, r"non-empty 1-D integer"),
]
GPT_OSS = (("clamped_swiglu", 1.702, 7.0), True)  # (act, biases)


def routing(T, E, A, experts=None):
    pool = np.arange(E) if experts is None else np.asarray(experts)
    ids = np.stack([RNG.permutation(pool)[:A] for _ in range(T)]).astype(np.int32)  # [T, A] distinct per token
    w = RNG.random((T, A)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def expert_map(E, experts):
    m = np.full(E, -1, np.int32)  # [E_total]
    m[experts] = np.arange(len(experts), dtype=np.int32)
    return m


def run(backend, x, tw, ids, gate_up, down, bias=None, act=None, emap=None):
    """fused_moe on one backend with host arrays in and out (cuda-emu: uploaded, run on the device, read back)."""
    fn = get_op("fused_moe", backend)
    if backend != "cuda-emu":
        return fn(x, tw, ids, gate_up, down, bias, act, expert_map=emap)
    from toolkit.gpu.ops import upload_qtensor

    dev = fn.__self__.dev
    def up(a):
        return None if a is None else dev.to_device(a)

    out = fn(up(x), up(tw), up(ids), upload_qtensor(dev, gate_up), upload_qtensor(dev, down),
             None if bias is None else tuple(map(up, bias)), act, expert_map=up(emap))
    return dev.to_host(out)


def layer(E, D, I, bias):
    gu = (RNG.standard_normal((E, 2 * I, D)) * 0.2).astype(np.float32)
    dn = (RNG.standard_normal((E, D, I)) * 0.2).astype(np.float32)
    b = (RNG.standard_normal((E, 2 * I)).astype(np.float32), RNG.standard_normal((E, D)).astype(np.float32))
    return gu, dn, b if bias else None


def split(groups, gu, dn, bias):
    """Per group: its format's stacked QTensors of the group's experts, the local biases, and the map;
    plus the dequantized weights of every expert (the oracle's)."""
    gu_d, dn_d, parts = np.zeros_like(gu), np.zeros_like(dn), []
    for spec, experts in groups:
        f = get_format(spec)
        qg, qd = f.quantize(gu[experts], "numba"), f.quantize(dn[experts], "numba")
        gu_d[experts], dn_d[experts] = qg.dequantize(), qd.dequantize()
        b = None if bias is None else (bias[0][experts], bias[1][experts])
        parts.append((qg, qd, b, expert_map(gu.shape[0], experts)))
    return parts, gu_d, dn_d


@pytest.mark.parametrize("act,biases", [(None, False), GPT_OSS], ids=["swiglu", "gpt-oss"])
@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_format_groups_sum_to_the_layer(backend, shape, groups, act, biases):
    T, E, A, D, I = shape
    gu, dn, bias = layer(E, D, I, biases)
    parts, gu_d, dn_d = split(GROUPS[groups], gu, dn, bias)
    ids, tw = routing(T, E, A)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    got = sum(run(backend, x, tw, ids, qg, qd, b, act, m) for qg, qd, b, m in parts)
    want = get_op("moe_experts", "numpy")(x, ids, tw, gu_d, dn_d, bias, act)
    assert_close(got, want, atol=TOL * float(np.abs(want).max()) + 1e-6, what=f"{backend} {groups} T={T}")


@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_without_tokens_gives_exact_zeros(backend, T, biases):
    E, A, D, I = 6, 2, 64, 64
    gu, dn, bias = layer(E, D, I, biases)
    _, (qg, qd, b, m) = split(GROUPS["two"], gu, dn, bias)[0]
    ids, tw = routing(T, E, A, experts=GROUPS["two"][0][1])  # every token on the other group's experts
    x = RNG.standard_normal((T, D)).astype(np.float32)
    act = GPT_OSS[0] if biases else None
    assert_close(run(backend, x, tw, ids, qg, qd, b, act, m), np.zeros((T, D), np.float32), exact=True)


@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_map_is_no_map(backend, T):
    """A map that keeps every expert where it is: the same bits as no map (the same layout, the same kernels)."""
    E, A, D, I = 6, 2, 64, 64
    gu, dn, _ = layer(E, D, I, False)
    f = get_format("int4-g32")
    qg, qd = f.quantize(gu, "numba"), f.quantize(dn, "numba")
    ids, tw = routing(T, E, A)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    assert_close(run(backend, x, tw, ids, qg, qd, emap=np.arange(E, dtype=np.int32)),
                 run(backend, x, tw, ids, qg, qd), exact=True)


@pytest.mark.parametrize("emap,E_local,message", BAD_MAPS)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_bad_maps_are_refused(backend, T, emap, E_local, message):
    D, I = 64, 64
    f = get_format("int8")
    qg, qd = f.quantize(np.zeros((E_local, 2 * I, D), np.float32)), f.quantize(np.zeros((E_local, D, I), np.float32))
    ids = np.array([[2, 1], [0, 1], [0, 2], [1, 0], [2, 0]], np.int32)[:T]
    x, tw = np.ones((T, D), np.float32), np.full((T, 2), 0.5, np.float32)
    with pytest.raises(ValueError, match=message):
        run(backend, x, tw, ids, qg, qd, emap=emap)


def test_bad_maps_on_the_device():
    """The device checks what it can see without reading the map back (dtype, rank, size); values are checked
    on the host where maps are built (check_expert_map), and the remap kernel turns out-of-range ids and
    values into -1 (nothing out of bounds is read; such slots add nothing)."""
    from toolkit.layouts import check_expert_map

    E, A, D, I = 4, 2, 64, 64
    f = get_format("int8")
    gu, dn, _ = layer(E, D, I, False)
    qg, qd = f.quantize(gu), f.quantize(dn)
    ids, tw = routing(3, E, A)
    x = RNG.standard_normal((3, D)).astype(np.float32)
    rt = EmuDevice()
    for emap, message in [(np.zeros(4, np.int64), r"expert_map.dtype is int64"),
                          (np.zeros((2, 2), np.int32), r"expert_map has 2 dims"),
                          (np.zeros(0, np.int32), r"expert_map \[E_total\] must not be empty")]:
        with pytest.raises(BackendError, match=rf"moe_align.*{message}"):
            run_fused_moe(rt, x, tw, ids, qg, qd, 16, expert_map=emap)
    with pytest.raises(ValueError, match=r"values must lie in \[-1, 4\)"):
        check_expert_map(np.array([0, 4, 1, 2], np.int32), E)
    short = np.array([0, 1], np.int32)  # experts 2 and 3 lie past the map; a value past E_local
    bad = np.array([0, 1, 7, -5], np.int32)
    want = get_op("fused_moe", "numpy")(x, tw, ids, qg, qd, expert_map=np.array([0, 1, -1, -1], np.int32))
    for emap in (short, bad):  # both keep experts 0 and 1 only
        assert_close(run_on(rt, run_fused_moe, x, tw, ids, qg, qd, 16, expert_map=emap), want,
                     atol=TOL * float(np.abs(want).max()) + 1e-6)


# ---- moe_align with a map: the layout of the local experts, exact ------------------------------------------
@pytest.mark.parametrize("T,E,A,bm", [(1, 8, 2, 16), (7, 6, 4, 16), (40, 8, 2, 64)])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_moe_align_with_a_map(T, E, A, bm, order):
    ids, _ = routing(T, E, A)
    experts = [6 % E, 1, 3]
    emap = expert_map(E, experts)
    sr, er, Pr = get_op("moe_align", "numpy")(ids, len(experts), bm, expert_map=emap)
    flat = ids.reshape(-1)
    assert sorted(sr[sr < flat.size].tolist()) == np.nonzero(np.isin(flat, experts))[0].tolist()  # mapped slots once
    assert (emap[flat[sr.reshape(-1, bm)[:, 0]]] == er).all()  # a block's first slot is of its (local) expert
    s, e, P = get_op("moe_align", "numba")(ids, len(experts), bm, expert_map=emap)
    assert_close(s, sr, exact=True, what="numba sorted_ids")
    assert_close(e, er, exact=True, what="numba expert_ids")
    assert P == Pr
    s, e, total = run_on(EmuDevice(reverse=order == "reverse"), run_moe_align, ids, len(experts), bm, expert_map=emap)
    assert int(total[0]) == Pr
    assert_close(s[:Pr], sr, exact=True, what="cuda sorted_ids")
    assert_close(e[: Pr // bm], er, exact=True, what="cuda expert_ids")
    assert (s[Pr:] == flat.size).all() and (e[Pr // bm:] == -1).all()


# ---- the tensor-core path (an sm_90 device; its GEMM kernel writes only routed rows) ----------------------
@pytest.mark.parametrize("T", [1, 40])
def test_format_groups_on_tensor_cores(T):
    rt = EmuDevice(arch=900)  # poisoned fresh buffers: a -1 slot's row left unwritten would be NaN
    E, A, D, I = 6, 2, 128, 128
    gu, dn, _ = layer(E, D, I, False)
    parts, gu_d, dn_d = split(GROUPS["three"], gu, dn, None)
    ids, tw = routing(T, E, A)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    got = sum(run_on(rt, run_fused_moe, x, tw, ids, qg, qd, block_m_for(T * A, qg.shape[0]), expert_map=m)
              for qg, qd, _, m in parts)
    want = get_op("moe_experts", "numpy")(x, ids, tw, gu_d, dn_d)
    assert_close(got, want, atol=ROUNDING_TOL * float(np.abs(want).max()))


def test_a_recorded_step_reads_the_map_on_the_device():
    """The map is a device array read by a kernel: a step recorded once and replayed with another map (copied
    into the same buffer) gives that map's result, and recording (which refuses host reads) succeeds."""
    from toolkit.gpu.device import Plan
    from toolkit.gpu.ops import upload_qtensor

    dev = EmuDevice()
    T, E, A, D, I = 3, 4, 2, 64, 64
    gu, dn, _ = layer(E, D, I, False)
    f = get_format("int8")
    qg, qd = f.quantize(gu), f.quantize(dn)
    ids, tw = routing(T, E, A)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    up = dev.to_device
    m = up(np.array([0, 1, 2, 3], np.int32))
    plan = Plan()
    with dev.recording(plan):
        out = run_fused_moe(dev, up(x), up(tw), up(ids), upload_qtensor(dev, qg), upload_qtensor(dev, qd), 16,
                            expert_map=m)
    for emap in (np.array([-1, 1, -1, 3], np.int32), np.array([0, -1, 2, -1], np.int32)):
        dev.copy_in(m, emap)
        plan.replay(dev)
        want = get_op("fused_moe", "numpy")(x, tw, ids, qg, qd, expert_map=emap)
        assert_close(dev.to_host(out), want, atol=TOL * float(np.abs(want).max()) + 1e-6)
