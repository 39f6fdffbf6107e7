"""Expert parallelism on Ray (``toolkit/dist``): routed experts on 1, 2 and 4 expert ranks (Ray actors of a
single-node cluster started once for this module), each loading only its experts from the same file.

- Parity, as a table (ranks x family x format x source): prefill of a batch of two prompts of different lengths,
  then decode steps, logits equal to the single-process run within ``TOL``; greedy text token-identical. Mixtral,
  DeepSeek-V3 (MLA, shared expert, grouped router, a leading dense layer) and gpt-oss (expert biases, clamped
  SwiGLU) test configs, f32 and MoQE int4 / q4_0 and a mixed plan; a UQFF bundle and a GGUF file as sources; a split
  balanced from a routing trace.
- What each process holds: every rank exactly its experts' bytes (their sum the single process's), the driver none.
- The split (contiguous, balanced) as pure functions, against a brute-force optimum.
- Faults: a rank killed during decode ends that call with an error naming the rank and the layer within the hop
  timeout, Ray restarts it, and the next request runs and matches; a rank that cannot load fails the start with
  its reason; a cluster that cannot place the ranks says so.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from test_parity_hf import case  # noqa: E402,F401  (the module-scoped checkpoint fixture, indirect below)
from test_uqff_support import _with_tokenizer  # noqa: E402
from toolkit.dist import EPSpec, RankError, balanced, contiguous  # noqa: E402
from toolkit.load import load_model  # noqa: E402
from toolkit.model import SamplingParams, generate_tokens  # noqa: E402
from toolkit.quant import parse_policy  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "model"
TOL = 1e-5  # max abs logit difference: the same kernels, the ranks' partial sums added in another order


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One single-node Ray for the module (Ray's local mode no longer exists): 5 logical CPUs, so 4 ranks of one
    CPU each fit beside the driver on this 2-core machine."""
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _policy(fmt, d, tmp_path):
    if fmt is None:
        return None
    if fmt == "plan":  # a mixed plan: every expert of every MoE layer its own choice among three widths
        from toolkit.model import load_config
        from toolkit.quant.plan import plan_policy, write_plan

        cfg = load_config(d)
        widths = ["int4-g32", "int8", "q4_0"]
        lines = {f"layers.{i}.moe.{p}.{e}": widths[(e + k) % 3] for i in range(cfg.num_layers) if cfg.moe_layers[i]
                 for k, p in enumerate(("gate_up", "down")) for e in range(cfg.num_experts)}
        write_plan(tmp_path / "mix.plan", lines, ["test plan"])
        return plan_policy(tmp_path / "mix.plan", cfg)
    return parse_policy("moqe", fmt)


def _source(kind, d, policy, tmp_path):
    """The file both sides read: the checkpoint, a UQFF bundle of it, or a GGUF file of it."""
    if kind == "hf":
        return d, policy
    if kind == "uqff":
        from toolkit.uqff.writer import save_bundle

        save_bundle(d, tmp_path / "b.uqff", policy)
        return tmp_path / "b.uqff", None
    from toolkit.gguf.export import export_gguf

    pytest.importorskip("gguf")
    export_gguf(d, tmp_path / "m.gguf", policy)
    return tmp_path / "m.gguf", None


def _run(m, ids):
    """Prefill of two prompts (8 and 5 tokens), then decode steps of both -> all logits [rows, V]."""
    tokens = np.stack([ids[0, :8], np.r_[ids[0, 3:8][::-1], 0, 0, 0]])
    cache = m.new_cache(2, ids.shape[1])
    pre = m.forward(tokens, cache, lengths=np.array([8, 5]))  # [2, 8, V]
    steps = [m.decode(np.stack([ids[0, t], ids[0, t - 3]]), cache) for t in range(8, ids.shape[1])]
    return np.concatenate([pre[0], pre[1, :5], *steps])


def _greedy(m, ids, n=6):
    return [ev.token for ev in generate_tokens(m, [list(ids[0])], SamplingParams(max_new_tokens=n))]


# (checkpoint case, ranks, format, source, split, transport): formats None = f32, MoQE int4 / q4_0, a mixed plan.
# Each axis (ranks 1 / 2 / 4, format, source, balanced split, family, transport) is covered; not every product (each
# case starts 2-4 processes: the suite's slowest test)
PARITY = [("mixtral-gqa", 1, None, "hf", None, "graph"), ("mixtral-gqa", 2, None, "hf", None, "graph"),
          ("mixtral-gqa", 2, "int4", "hf", None, "calls"), ("mixtral-gqa", 4, "q4_0", "hf", None, "graph"),
          ("mixtral-gqa", 2, "plan", "hf", None, "graph"), ("mixtral-gqa", 2, "int4", "uqff", None, "graph"),
          ("mixtral-gqa", 2, "plan", "uqff", None, "calls"), ("mixtral-gqa", 2, "q4_0", "gguf", None, "graph"),
          ("mixtral-gqa", 2, None, "hf", "trace", "graph"),
          ("deepseekv3", 2, None, "hf", None, "graph"), ("deepseekv3", 4, "plan", "hf", None, "calls"),
          ("gptoss", 2, None, "hf", None, "calls"), ("gptoss", 4, "q4_0", "gguf", None, "graph")]


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.mark.parametrize("case,ranks,fmt,source,split,transport", PARITY, indirect=["case"],
                         ids=[f"{c}-ep{n}-{f or 'f32'}-{s}" + ("-balanced" if b else "") + f"-{t}"
                              for c, n, f, s, b, t in PARITY])
def test_ranks_give_the_single_process_logits(case, ranks, fmt, source, split, transport, tmp_path):
    name, _, d, ids = case
    _with_tokenizer(d)
    policy = _policy(fmt, d, tmp_path)
    src, pol = _source(source, d, policy, tmp_path)
    trace_path = None
    if split == "trace":
        from toolkit.quant import trace

        one, _ = load_model(src, policy=pol)
        trace.save(tmp_path / "t.trace", trace.record(one, ids[0]))
        trace_path = str(tmp_path / "t.trace")
    single, _ = load_model(src, policy=pol)
    want = _run(single, ids)
    m, _ = load_model(src, policy=pol, ep=EPSpec(ranks, split=trace_path, transport=transport))
    try:
        got = _run(m, ids)
        diff = float(np.abs(got - want).max())
        print(f"parity | {name} | {ranks} | {fmt or 'f32'} | {source}{' (balanced)' if split else ''} | {diff:.2g} |")
        assert diff <= TOL, f"{name} ep{ranks} {fmt}: max abs logit difference {diff}"
        assert _greedy(m, ids) == _greedy(single, ids)
        # what each process holds: the driver no routed expert, each rank its own experts' bytes, their sum the whole
        assert m.weight_bytes()["experts"] == 0
        assert all(getattr(l.ffn, "expert_weights", None) is None for l in m.layers)
        infos = m.cluster.infos
        assert sum(i["expert_bytes"] for i in infos) == single.weight_bytes()["experts"], infos
        if split is None and fmt in (None, "int4", "q4_0"):  # one format, contiguous split: bytes follow the counts
            E = single.cfg.num_experts
            sizes = [len(m.split.experts(r, next(iter(m.split.rank_ids(r))))) for r in range(ranks)]
            for info, n in zip(infos, sizes):
                assert info["expert_bytes"] * E == single.weight_bytes()["experts"] * n
        assert m.cluster.stats["hops"] > 0
        assert (m.cluster.dag is not None) == (transport == "graph")
        if os.path.isdir("/proc"):  # torch is installed here: Ray's channels would import it in each rank (~4 s, 225 MB)
            assert all("libtorch" not in _maps(i["pid"]) for i in infos), "a rank imported torch"
    finally:
        m.cluster.close()


@pytest.mark.parametrize("case", ["mixtral-gqa"], indirect=True)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads a rank's CPU time from /proc")
def test_ranks_on_calls_sleep_while_they_wait(case):
    """``transport="calls"``: between hops a rank waits without CPU (a compiled graph's channel read spins at 100 %
    of a core); its CPU time over 2 idle seconds stays far below them."""
    name, _, d, ids = case
    _with_tokenizer(d)
    m, _ = load_model(d, ep=EPSpec(2, transport="calls"))
    try:
        _run(m, ids)

        def cpu_s(pid):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        pids = [i["pid"] for i in m.cluster.infos]
        before = [cpu_s(p) for p in pids]
        time.sleep(2.0)
        used = [cpu_s(p) - b for p, b in zip(pids, before)]
        assert max(used) < 0.5, f"ranks used {used} s of CPU in 2 s of waiting"
    finally:
        m.cluster.close()


def test_a_rank_holds_its_share_of_the_expert_memory():
    """Peak RSS of each rank's process, from its start to the end of its load: at 2 ranks each grows by about half
    of what the single rank of a 1-rank run grows by (the runtime's own memory cancels out); the difference is at
    least 0.35 of the experts' bytes (0.5 ideal) and the 1-rank growth covers the experts it holds."""
    growth, total = {}, None
    for n in (1, 2):
        m, _ = load_model(BUNDLED, ep=EPSpec(n))
        try:
            infos = m.cluster.infos
            growth[n] = max(i["load_peak"] - i["rss_start"] for i in infos)
            total = sum(i["expert_bytes"] for i in infos)
        finally:
            m.cluster.close()
    assert growth[1] >= 0.9 * total, (growth, total)
    assert growth[2] <= growth[1] - 0.35 * total, (growth, total)


# ---- the split ------------------------------------------------------------------------------------------------
def _cfg(E, L=3, moe=(False, True, True)):
    return SimpleNamespace(num_layers=L, num_experts=E, moe_layers=list(moe), top_k=2)


SPLITS = [(8, 2, [0, 0, 0, 0, 1, 1, 1, 1]), (8, 4, [0, 0, 1, 1, 2, 2, 3, 3]), (6, 4, [0, 0, 1, 1, 2, 3]),
          (4, 4, [0, 1, 2, 3]), (5, 1, [0] * 5)]


@pytest.mark.parametrize("E,N,row", SPLITS)
def test_contiguous_split(E, N, row):
    s = contiguous(_cfg(E), N)
    assert (s.owner[0] == -1).all() and s.owner[1].tolist() == row and s.owner[2].tolist() == row
    ids = s.rank_ids(N - 1)
    assert sorted(ids) == [1, 2] and all(ids[i].tolist() == np.flatnonzero(np.array(row) == N - 1).tolist() for i in ids)


def _best(counts, N):
    """The smallest possible busiest-rank load with equal expert counts per rank (brute force, tiny E)."""
    from itertools import permutations

    E = len(counts)
    sizes = [E // N + (r < E % N) for r in range(N)]
    row = np.repeat(np.arange(N), sizes)
    return min(np.bincount(np.array(p), counts, N).max() for p in set(permutations(row)))


@pytest.mark.parametrize("seed", range(6))
def test_balanced_split_evens_the_expected_tokens(seed):
    rng = np.random.default_rng(seed)
    E, N = 6, 2 + seed % 2
    counts = rng.zipf(1.5, size=(2, E)).astype(np.int64) * 10
    tr = SimpleNamespace(layers=(1, 2), experts=E, top_k=2, counts=counts)
    s = balanced(_cfg(E), N, tr)
    for j, i in enumerate((1, 2)):
        assert sorted(np.bincount(s.owner[i], minlength=N).tolist()) == sorted([E // N + (r < E % N) for r in range(N)])
        got = np.bincount(s.owner[i], counts[j], N).max()
        contig = np.bincount(contiguous(_cfg(E), N).owner[i], counts[j], N).max()
        assert got <= contig
        assert got <= _best(counts[j], N) * 4 / 3 + 1e-9  # greedy (LPT) within 4/3 of the optimum


def test_ep_transport_flag_names_the_hop_transport(capsys):
    from toolkit.cli import _ep, build_parser
    from toolkit.errors import ToolkitError

    p = build_parser()
    assert _ep(p.parse_args(["generate", "--prompt", "x", "--ep", "2"])).transport == "graph"
    assert _ep(p.parse_args(["generate", "--prompt", "x", "--ep", "2", "--ep-transport", "calls"])).transport == "calls"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "x", "--ep", "2", "--ep-transport", "nccl"])
    assert "--ep-transport" in capsys.readouterr().err
    with pytest.raises(ToolkitError, match="--ep-transport must be one of calls, graph, got 'nccl'"):
        EPSpec(2, transport="nccl")


def test_split_refuses_what_cannot_be():
    from toolkit.errors import ToolkitError

    with pytest.raises(ToolkitError, match="8 routed experts per layer"):
        contiguous(_cfg(8), 9)
    with pytest.raises(ToolkitError, match="at least 1"):
        EPSpec(0)
    tr = SimpleNamespace(layers=(1,), experts=8, top_k=2, counts=np.ones((1, 8)))
    with pytest.raises(ToolkitError, match="traced MoE layers"):
        balanced(_cfg(8), 2, tr)


# ---- faults -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["graph", "calls"])
@pytest.mark.parametrize("case", ["mixtral-gqa"], indirect=True)
def test_a_rank_killed_during_decode_ends_that_request_and_comes_back(case, transport):
    name, _, d, ids = case
    _with_tokenizer(d)
    single, _ = load_model(d)
    want = _greedy(single, ids)
    m, _ = load_model(d, ep=EPSpec(2, timeout=60, transport=transport))
    try:
        pid = m.cluster.infos[1]["pid"]
        steps = {"n": 0}
        inner = m.layers[-1].ffn.experts

        def kill_on_third(x, i, w):  # the rank's process dies between decode steps of one request
            steps["n"] += 1
            if steps["n"] == 3:
                os.kill(pid, signal.SIGKILL)
            return inner(x, i, w)

        m.layers[-1].ffn.experts = kill_on_third
        t0 = time.monotonic()
        with pytest.raises(RankError, match=rf"expert rank 1 \(pid {pid} .*\) was lost during layer 1"):
            _greedy(m, ids)
        assert time.monotonic() - t0 < 60
        m.layers[-1].ffn.experts = inner
        t0 = time.monotonic()
        assert _greedy(m, ids) == want  # the next request waits for the restarted rank, which reloaded its experts
        assert m.cluster.infos[1]["pid"] != pid
    finally:
        m.cluster.close()


@pytest.mark.parametrize("case", ["mixtral-gqa"], indirect=True)
def test_a_rank_that_cannot_load_fails_the_start_with_its_reason(case, tmp_path):
    name, _, d, ids = case
    _with_tokenizer(d)
    with pytest.raises(RankError, match="expert rank 1 could not load its experts: .*not enough memory for 2 experts"):
        load_model(d, ep=EPSpec(2, fail=((1, "not enough memory for 2 experts"),), restarts=0))
    with pytest.raises(RankError, match="cannot place 2 expert rank"):
        load_model(d, ep=EPSpec(2, cpus=64, load_timeout=5))


# ---- the command line -----------------------------------------------------------------------------------------
def test_info_prints_the_bytes_of_each_rank(capsys, tmp_path):
    """``moqe info --ep N``: each rank's experts and bytes (from the config alone), the driver none; the ranks' sum
    is what the loaded model holds, and a 2-rank run loads exactly the bytes the table says per rank."""
    from toolkit.cli import main

    assert main(["info", "--model", str(BUNDLED), "--ep", "4", "--experts", "q4_0"]) == 0
    out = capsys.readouterr().out
    rows = [l.split("|")[1:-1] for l in out.splitlines() if l.startswith("|  rank ") or l.startswith("|  driver")]
    rows = {r[0].strip(): [c.strip() for c in r] for r in rows}
    assert [rows[f"rank {r}"][1] for r in range(4)] == ["0-1", "2-3", "4-5", "6-7"]
    per_rank = {int(rows[f"rank {r}"][2]) for r in range(4)}
    single, _ = load_model(BUNDLED, policy=parse_policy("moqe", "q4_0"))
    assert per_rank == {single.weight_bytes()["experts"] // 4} and rows["driver"][2] == "0"
    (tmp_path / "x.trace").write_bytes(b"x")
    assert main(["info", "--model", str(BUNDLED), "--ep-split", str(tmp_path / "x.trace")]) != 0  # without --ep: refused
    assert "give --ep too" in capsys.readouterr().err


def test_generate_with_ep_prints_the_single_process_text():
    """``moqe generate --ep 2`` (a local Ray started for the run, its own): the same greedy text as one process."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "toolkit", "generate", "--model", str(BUNDLED), "--experts", "int4",
            "--prompt", "It is a truth universally acknowledged", "--max-new-tokens", "12"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BUNDLED.parents[1]), os.environ.get("PYTHONPATH")]))}
    one = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    ep = subprocess.run(argv + ["--ep", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0 and ep.returncode == 0, (one.stderr[-2000:], ep.stderr[-2000:])
    text = lambda r: [l for l in r.stdout.splitlines() if l and not l.startswith("[")]  # noqa: E731
    assert text(ep) == text(one) and len("".join(text(one))) > 40


def test_bench_ep_rows_measure_each_process():
    """``python -m toolkit.bench ep`` on the bundled model, one process and 2 ranks (each in a fresh process): the
    ranks' expert bytes add up to the single process's, the driver holds none, a hop moves bytes and takes time,
    and the prediction row is built from the measured parts."""
    from toolkit.bench.ep import run

    rows = run(["--ranks", "0,2", "--tokens", "3", "--empty-hops", "5", "--experts", "q4_0"])
    one, two = rows
    assert one["ranks"] == "1 process" and two["ranks"] == 2 and two["driver expert MB"] == 0
    assert (one["transport"], two["transport"]) == ("-", "graph")  # the default transport
    assert sum(float(v) for v in two["expert MB per rank"].split("/")) == pytest.approx(one["driver expert MB"], abs=0.11)
    out, back = (int(v) for v in two["hop bytes out/back"].split("/"))
    assert out > back > 0 and two["hop ms (median)"] > 0 and two["empty hop us (median)"] > 0
    assert all(float(v) > 0 for v in two["peak RSS MB per rank"].split("/"))
