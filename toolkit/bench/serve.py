"""``python -m toolkit.bench serve``: a bounded load test of ``moqe serve`` on loopback.

A server on 127.0.0.1 (the bundled model unless ``--model``) takes a fixed set of requests: prompts cut from
``data/heldout.txt`` at different lengths, greedy, ``ignore_eos`` and one ``max_tokens`` so that every request
does the same work however it is scheduled. They are sent twice, interleaved by round:

- **one at a time**: each request streamed after the previous one finished (no batching possible);
- **C clients at once**: C threads, each streaming requests from a shared list until it is empty (continuous
  batching: the server's running batch holds up to C sequences).

Checked, for every request: its stream ended with ``[DONE]`` after one ``finish_reason``, its text holds
``max_tokens`` tokens (``usage``), its id is unique, and its greedy tokens equal the one-at-a-time run's.
Reported: generated tokens/s of each mode and their ratio, time to first token (p50, p99) and time per output
token (p50) as the clients saw them, and the server's decode batch sizes. A wall-clock limit stops the run.

    python -m toolkit.bench serve [--clients 16] [--requests 64] [--max-tokens 64] [--rounds 2] [--limit-s 900]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from .timing import print_table


def _stream(url: str, body: dict, client) -> dict:
    """One streamed completion: -> its ids, text, token ids, finish reasons, time to first token and token times."""
    t0 = time.perf_counter()
    out = {"ids": set(), "text": "", "tokens": [], "finish": [], "ttft": None, "times": [], "done": False, "usage": None}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            out["ids"].add(chunk["id"])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for c in chunk["choices"]:
                now = time.perf_counter() - t0
                if c.get("text"):
                    out["ttft"] = now if out["ttft"] is None else out["ttft"]
                    out["times"].append(now)
                    out["text"] += c["text"]
                if c.get("finish_reason"):
                    out["finish"].append(c["finish_reason"])
                    out["tokens"] = c.get("token_ids", [])
    out["wall"] = time.perf_counter() - t0
    return out


def _requests(tok, n: int, max_tokens: int, context: int) -> list[dict]:
    text = (Path(__file__).resolve().parents[2] / "data" / "heldout.txt").read_text(encoding="utf-8")
    ids = tok.encode(text, add_bos=False)
    out = []
    for i in range(n):
        length = 8 + (i * 37) % 120  # prompts of 8 .. 127 tokens
        length = min(length, context - max_tokens - 1)
        start = (i * 997) % (len(ids) - length)
        out.append({"prompt": ids[start:start + length], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}})
    return out


def _one_at_a_time(url, reqs, client, deadline) -> tuple[list, float]:
    t0, res = time.perf_counter(), []
    for body in reqs:
        if time.perf_counter() > deadline:
            raise TimeoutError("the wall-clock limit was reached (one at a time)")
        res.append(_stream(url, body, client))
    return res, time.perf_counter() - t0


def _concurrent(url, reqs, clients: int, deadline) -> tuple[list, float]:
    import httpx

    res, todo, lock, errors = [None] * len(reqs), list(range(len(reqs))), threading.Lock(), []

    def worker():
        with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
            while True:
                with lock:
                    if not todo or time.perf_counter() > deadline:
                        return
                    i = todo.pop(0)
                try:
                    res[i] = _stream(url, reqs[i], client)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(f"request {i}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.perf_counter() + 60))
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    if any(r is None for r in res):
        raise TimeoutError("the wall-clock limit was reached (concurrent)")
    return res, time.perf_counter() - t0


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class _Server:
    """``moqe serve`` in a process of its own (the clients' work does not share its interpreter), on a free port."""

    def __init__(self, model: str, backend: str, slots: int, queue: int, threads, experts):
        import socket
        import subprocess
        import sys

        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "toolkit", "serve", "--model", model, "--backend", backend, "--port", str(port),
               "--slots", str(slots), "--max-queue", str(queue), "--served-model-name", "bench", "--log-level", "error"]
        cmd += ["--threads", str(threads)] if threads else []
        cmd += ["--experts", experts] if experts else []
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moqe serve exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("moqe serve did not answer within 600 s")

    def batches(self) -> tuple[float, float]:
        """(sum, count) of the server's decode batch sizes so far."""
        import httpx

        got = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            for key in ("moqe_decode_batch_size_sum", "moqe_decode_batch_size_count"):
                if line.startswith(key):
                    got[key] = float(line.rsplit(" ", 1)[1])
        return got.get("moqe_decode_batch_size_sum", 0.0), got.get("moqe_decode_batch_size_count", 0.0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:  # noqa: BLE001
            self.proc.kill()


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench serve")
    ap.add_argument("--model", default=None, help="model folder or bundle (default: the bundled model)")
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--experts", default=None, help="the server's --experts format (default: none, f32)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (default %(default)s)")
    ap.add_argument("--requests", type=int, default=64, help="requests per mode and round (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each mode once per round (default %(default)s)")
    ap.add_argument("--limit-s", type=float, default=900.0, help="wall-clock limit of the whole run (default %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="the server's CPU threads (default: every core)")
    args = ap.parse_args(argv)

    import os

    import httpx

    from ..cli import DEFAULT_MODEL
    from ..model.tokenizer import Tokenizer

    deadline = time.perf_counter() + args.limit_s
    model = args.model or DEFAULT_MODEL
    tok = Tokenizer(model)
    server = _Server(model, args.backend, args.clients, max(64, args.requests), args.threads, args.experts)
    try:
        context = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
        reqs = [{"model": "bench", **r} for r in _requests(tok, args.requests, args.max_tokens, context)]
        rows, seen_ids = [], set()
        with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
            for body in reqs[:: max(1, len(reqs) // 4)]:  # the kernels for these prompt lengths, before any timing
                _stream(server.url, {**body, "max_tokens": 2}, client)
            _concurrent(server.url, [{**b, "max_tokens": 4} for b in reqs[: args.clients]], args.clients, deadline)
            for rnd in range(args.rounds):
                b0 = server.batches()
                seq, t_seq = _one_at_a_time(server.url, reqs, client, deadline)
                b1 = server.batches()
                con, t_con = _concurrent(server.url, reqs, args.clients, deadline)
                b2 = server.batches()
                batch = {"one at a time": (b1[0] - b0[0]) / max(1, b1[1] - b0[1]),
                         "concurrent": (b2[0] - b1[0]) / max(1, b2[1] - b1[1])}
                for mode, res, wall in (("one at a time", seq, t_seq), (f"{args.clients} clients", con, t_con)):
                    for r in res:
                        ok = r["done"] and len(r["finish"]) == 1 and r["usage"]["completion_tokens"] == args.max_tokens
                        if not ok or len(r["ids"]) != 1 or r["ids"] & seen_ids:
                            raise RuntimeError(f"{mode}: a stream was incomplete or duplicated: {r['finish']}, {r['usage']}")
                        seen_ids |= r["ids"]
                    tokens = sum(r["usage"]["completion_tokens"] for r in res)
                    tpot = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
                    rows.append({"round": rnd + 1, "mode": mode, "requests": len(res), "tokens": tokens,
                                 "wall s": wall, "tok/s": tokens / wall,
                                 "TTFT p50 ms": 1e3 * _pct([r["ttft"] for r in res], 50),
                                 "TTFT p99 ms": 1e3 * _pct([r["ttft"] for r in res], 99),
                                 "TPOT p50 ms": 1e3 * statistics.median(tpot) if tpot else None,
                                 "mean decode batch": batch["one at a time" if mode == "one at a time" else "concurrent"]})
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(seq, con))
                rows[-1]["greedy tokens = one at a time"] = f"{same}/{len(seq)}"
                rows[-2]["greedy tokens = one at a time"] = "(reference)"
        speed = [rows[i + 1]["tok/s"] / rows[i]["tok/s"] for i in range(0, len(rows), 2)]
        print_table(rows, f"moqe serve on loopback: {args.requests} requests x {args.max_tokens} tokens, greedy "
                          f"(ignore_eos), backend {args.backend}, experts {args.experts or 'f32'}, server threads "
                          f"{args.threads or os.cpu_count()}, clients in another process; prompts 8-127 tokens")
        print(f"continuous batching: {statistics.median(speed):.2f}x the tokens/s of one request at a time "
              f"(median of {len(speed)} rounds: {', '.join(f'{s:.2f}' for s in speed)})")
        return rows
    finally:
        server.stop()
