"""``python -m toolkit.bench ep``: what expert parallelism costs and saves on this machine (docs/expert-parallel.md).

For each model (the bundled one, and with ``--mixtral-layers L`` a Mixtral-shaped checkpoint of ``L`` layers of
random fp16 weights, ``toolkit.bench.layer``) and each ``--ranks`` entry (0: one process, no Ray), in a fresh
spawned process (its own peak resident set), the model is loaded as a user loads it (``load_model``, experts
quantized to ``--experts`` at load, ``ep=EPSpec(N)``), a prompt prefilled, then ``--tokens`` tokens decoded one by
one. Per row:

- decode ms per token (median over the tokens), and the hop's share: the median time of one layer's hop (send,
  the ranks' experts, sum) and of an empty hop (every rank sent zero rows: the fixed cost of a round trip through
  the transport, ``--transport``: a Ray Compiled Graph, or Ray actor calls), with the bytes a decode hop moves (out:
  rows, ids, weights; back: the ranks' sums);
- bytes of routed experts and peak RSS of every process: the driver (this child) and each rank (after the decode).

The prediction for a 32-layer model over a network: per token, ``32 x (local layer time + hop bytes / link rate +
link RTT)``, where the local layer time is this run's decode ms per token at N ranks over its MoE layers (the empty
hop's fixed cost included) and ``--link-gbps`` / ``--link-rtt-us`` are the assumed network (25 Gb/s, 30 us): an
estimate from measured parts, said so in its row. On this machine every rank shares the same 2 cores with the
driver: ranks above the core count measure contention, not parallel speed.
"""
from __future__ import annotations

import argparse
import time
from contextlib import ExitStack

import numpy as np

from .timing import RowStream, conditions

DEFAULT_MODEL = "data/model"


def _child(source: str, experts: str | None, ranks: int, prompt: int, tokens: int, empty_hops: int, cpus: int,
           transport: str = "graph") -> dict:
    from ..dist import EPSpec
    from ..dist.rank import peak_rss, rss
    from ..load import load_model
    from ..quant import parse_policy

    policy = parse_policy("moqe", experts) if experts else None
    t0 = time.perf_counter()
    m, _ = load_model(source, policy=policy, ep=EPSpec(ranks, cpus=cpus, transport=transport) if ranks else None)
    load_s = time.perf_counter() - t0
    V, moe = m.cfg.vocab_size, [i for i in range(m.cfg.num_layers) if m.cfg.moe_layers[i]]
    ids = (np.arange(prompt) * 7919 % (V - 3) + 3).astype(np.int64)
    cache = m.new_cache(1, prompt + tokens + 1)
    nxt = int(m.forward(ids[None], cache)[0, -1].argmax())
    cl = getattr(m, "cluster", None)
    if cl is not None:
        cl.hop_s.clear()
        cl.stats.update(hops=0, seconds=0.0, bytes_out=0, bytes_in=0)
    times = []
    for _ in range(tokens):
        t = time.perf_counter()
        nxt = int(m.decode(np.array([nxt]), cache)[0].argmax())
        times.append(time.perf_counter() - t)
    row = {"ranks": ranks or "1 process", "transport": transport if ranks else "-", "load s": load_s,
           "decode ms/token": 1e3 * float(np.median(times)), "MoE layers": len(moe),
           "driver expert MB": m.weight_bytes()["experts"] / 1e6}
    if cl is None:
        row.update({"hop ms (median)": "-", "hop bytes out/back": "-", "empty hop us (median)": "-",
                    "rank compute ms (median, slowest rank)": "-", "expert MB per rank": "-",
                    "peak RSS MB driver": peak_rss() / 1e6, "peak RSS MB per rank": "-", "RSS MB per rank now": "-",
                    "RSS MB driver now": rss() / 1e6})
        return row
    hops = max(cl.stats["hops"], 1)
    row["hop ms (median)"] = 1e3 * float(np.median(cl.hop_s))
    row["hop bytes out/back"] = f"{cl.stats['bytes_out'] // hops}/{cl.stats['bytes_in'] // hops}"
    D, A = m.cfg.hidden_size, m.cfg.top_k
    empty = []
    for _ in range(empty_hops):  # zero rows to every rank: the round trip alone
        t = time.perf_counter()
        cl.call(moe[0], np.zeros((0, D), np.float32), np.zeros((0, A), np.int32), np.zeros((0, A), np.float32),
                every=True)
        empty.append(time.perf_counter() - t)
    row["empty hop us (median)"] = 1e6 * float(np.median(empty))
    infos = cl.refresh()
    row["rank compute ms (median, slowest rank)"] = 1e3 * max(i["run_s"] or 0.0 for i in infos)
    row["expert MB per rank"] = "/".join(f"{i['expert_bytes'] / 1e6:.1f}" for i in infos)
    row["peak RSS MB driver"] = peak_rss() / 1e6
    row["peak RSS MB per rank"] = "/".join(f"{i['peak_rss'] / 1e6:.0f}" for i in infos)
    row["RSS MB per rank now"] = "/".join(f"{i['rss'] / 1e6:.0f}" for i in infos)
    row["RSS MB driver now"] = rss() / 1e6
    cl.close()
    return row


def _fault(source: str, experts: str | None, ranks: int, prompt: int) -> dict:
    """A rank's process killed (SIGKILL) between decode steps of a request: what the caller gets and when, and how
    long until the next request has its first token (Ray restarts the rank, which reloads its experts)."""
    import os
    import signal

    from ..dist import EPSpec, RankError
    from ..load import load_model
    from ..quant import parse_policy

    m, _ = load_model(source, policy=parse_policy("moqe", experts) if experts else None, ep=EPSpec(ranks))
    V = m.cfg.vocab_size
    ids = (np.arange(prompt) * 7919 % (V - 3) + 3).astype(np.int64)

    def request(n):
        cache = m.new_cache(1, prompt + n + 1)
        nxt = int(m.forward(ids[None], cache)[0, -1].argmax())
        for k in range(n):
            if k == 2 and kill:
                os.kill(m.cluster.infos[ranks - 1]["pid"], signal.SIGKILL)
                kill.clear()
                t[0] = time.perf_counter()
            nxt = int(m.decode(np.array([nxt]), cache)[0].argmax())

    kill, t = [True], [0.0]
    try:
        request(8)
        error = "none (the request finished)"
    except RankError as e:
        error = str(e)
    t_error = time.perf_counter() - t[0]
    t1 = time.perf_counter()
    request(1)
    back = time.perf_counter() - t1
    m.cluster.close()
    return {"ranks": ranks, "killed": f"rank {ranks - 1}", "error after s": t_error, "next request's first token after s":
            back, "what the caller got": f"RankError: {error}"}


def predict(row: dict, layers: int, gbps: float, rtt_us: float) -> dict:
    """32-layer decode ms/token with each rank on its own machine, from a row of N ranks measured here: per MoE layer,
    the driver's time (decode ms/token less the hops, over the layers), the slowest rank's expert compute, Ray's
    overhead of a hop (hop less that compute: measured on this machine, where the driver and the ranks share its
    cores), and the wire (the hop's bytes at ``gbps`` plus one ``rtt_us`` round trip, assumed)."""
    L = row["MoE layers"]
    hop, compute = row["hop ms (median)"], row["rank compute ms (median, slowest rank)"]
    driver = (row["decode ms/token"] - L * hop) / L
    out, back = (int(v) for v in row["hop bytes out/back"].split("/"))
    wire = (out + back) * 8 / (gbps * 1e9) * 1e3 + rtt_us / 1e3
    per = driver + compute + (hop - compute) + wire
    return {"ranks": row["ranks"], "transport": row["transport"], "driver ms/layer": driver,
            "rank compute ms/layer": compute, "Ray overhead ms/layer": hop - compute, "wire ms/layer": wire,
            "predicted ms/token": layers * per,
            "how": f"{layers} x (driver + rank compute + Ray overhead, measured here; + {out + back} B at {gbps:g} "
                   f"Gb/s + {rtt_us:g} us RTT, assumed)"}


def run(argv: list[str] | None = None) -> list[dict]:
    from .layer import MIXTRAL, _in_child, checkpoint, layer_config

    ap = argparse.ArgumentParser(prog="python -m toolkit.bench ep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint, UQFF bundle or GGUF file (default %(default)s)")
    ap.add_argument("--mixtral-layers", type=int, default=0, metavar="L",
                    help="also a Mixtral-shaped checkpoint of L layers (hidden 4096, 8 experts of 14336; 2.9 GB of "
                         "fp16 per layer, written to a temporary folder or --keep)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep (and reuse) the Mixtral-shaped checkpoint here")
    ap.add_argument("--experts", default="q4_0", help="expert format at load (default %(default)s; 'none': f32)")
    ap.add_argument("--ranks", default="0,1,2,4", help="comma list; 0 = one process (default %(default)s)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed (default %(default)s)")
    ap.add_argument("--empty-hops", type=int, default=200)
    ap.add_argument("--transport", default="graph", help="comma list of the hop's transports to measure, each a row per "
                    "rank count: calls (Ray actor calls), graph (a Ray Compiled Graph) (default %(default)s)")
    ap.add_argument("--link-gbps", type=float, default=25.0)
    ap.add_argument("--link-rtt-us", type=float, default=30.0)
    ap.add_argument("--rank-cpus", type=int, default=1, help="CPUs (kernel threads) per rank (default %(default)s)")
    ap.add_argument("--fault", action="store_true", help="also kill a rank mid-request and time the recovery")
    ap.add_argument("--rows", default=None, metavar="TSV", help="append every row to this file as it is measured")
    args = ap.parse_args(argv)
    experts = None if args.experts == "none" else args.experts
    ranks = [int(r) for r in args.ranks.split(",")]
    transports = args.transport.split(",")
    print(conditions([1]), flush=True)
    models = [(args.model, args.model)]
    rows = []
    with ExitStack() as stack:
        if args.mixtral_layers:
            d, _ = stack.enter_context(checkpoint(layer_config(MIXTRAL, args.mixtral_layers), args.keep))
            models.append((str(d), f"Mixtral-shaped, {args.mixtral_layers} layer(s)"))
        for source, name in models:
            table = RowStream(f"{name}, experts {args.experts}: one process against N expert ranks (Ray, {args.rank_cpus} "
                              f"CPU(s) each), {args.prompt}-token prompt, {args.tokens} decode tokens, each in a fresh process",
                              args.rows)
            got = [table.add(_in_child(_child, source, experts, r, args.prompt, args.tokens, args.empty_hops,
                                          args.rank_cpus, tr))
                   for r in ranks for tr in (transports if r else transports[:1])]
            rows += got
            pred = RowStream(f"{name}: predicted 32-layer decode across machines ({args.link_gbps:g} Gb/s link)", args.rows)
            for row in got:
                if row["ranks"] != "1 process":
                    pred.add(predict(row, 32, args.link_gbps, args.link_rtt_us))
    if args.fault:
        table = RowStream(f"{args.model}: a rank killed during decode (SIGKILL after the 3rd token)", args.rows)
        table.add(_in_child(_fault, args.model, experts, 2, args.prompt))
    print(conditions([1]) + " (after)", flush=True)
    return rows


if __name__ == "__main__":
    run()
