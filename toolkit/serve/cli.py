"""``moqe serve``: the command's flags and what it runs (docs/serving.md)."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    from ..cli import _declare_io, _model_args, _placement_args
    from ..numbers import flag, whole

    p = sub.add_parser("serve", help="serve the model over HTTP with OpenAI's API (/v1/completions, "
                                     "/v1/chat/completions), continuous batching and Prometheus /metrics")
    _model_args(p)
    _placement_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=flag(whole, lo=0, hi=65535), default=8000, help="default %(default)s (0: any free port)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name clients ask for in 'model' (default: the model folder's or file's name)")
    p.add_argument("--slots", type=flag(whole, lo=1, hi=1024), default=16,
                   help="sequences decoded together at most: the KV cache holds this many (default %(default)s)")
    p.add_argument("--context", type=flag(whole, lo=1, hi=1 << 24), default=None,
                   help="tokens per sequence, prompt and completion (default: the model's, at most 4096)")
    p.add_argument("--max-queue", type=flag(whole, lo=0, hi=1 << 20), default=64,
                   help="requests waiting at most; more are refused with 503 (default %(default)s)")
    p.add_argument("--prefill-chunk", type=flag(whole, lo=1, hi=1 << 20), default=512,
                   help="prompt tokens of each sequence per engine step (default %(default)s)")
    p.add_argument("--prefill-tokens", type=flag(whole, lo=1, hi=1 << 24), default=2048,
                   help="prompt tokens that may join one prefill batch (default %(default)s)")
    p.add_argument("--no-expert-stats", action="store_true",
                   help="do not count the routed experts per layer in /metrics (numba: lets one sequence decode "
                        "through the compiled decode step; cuda: lets the decode step be recorded and replayed)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn's log level (default %(default)s)")
    _declare_io(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from pathlib import Path

    from ..cli import _load
    from . import Server
    from .chat import load_chat_template

    template = load_chat_template(args.model)  # a template that does not parse: refused before the weights load
    model, tok = _load(args)
    name = args.served_model_name or Path(str(args.model).rstrip("/")).name
    server = Server(model, tok, name, template, host=args.host, port=args.port, log_level=args.log_level,
                    slots=args.slots, context=args.context, max_queue=args.max_queue,
                    prefill_chunk=args.prefill_chunk, prefill_tokens=args.prefill_tokens,
                    expert_stats=not args.no_expert_stats)
    e = server.engine
    kv = e.cache.nbytes / 1e6
    print(f"[moqe serve: '{name}' on backend {args.backend}, {e.slots} slots x {e.context} tokens (KV cache "
          f"{kv:.1f} MB), chat template: {'yes' if template else 'none (chat requests refused)'}; "
          f"http://{args.host}:{args.port}/v1]", file=sys.stderr, flush=True)
    server.run()
    return 0
