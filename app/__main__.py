"""``python -m app``: serve the MoQE comparison app (the README's main command)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from .ui import AppSettings, build_app  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    d = AppSettings()
    ap = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    ap.add_argument("--model", default=str(d.model), help="checkpoint directory or UQFF bundle (default: the bundled "
                    "model, %(default)s)")
    ap.add_argument("--host", default="127.0.0.1", help="address to serve on (default %(default)s)")
    ap.add_argument("--port", type=int, default=None, help="default: Gradio's (7860, or the next free port)")
    ap.add_argument("--output-root", default=str(d.output_root),
                    help="bundles are written and loaded only under this directory (default %(default)s)")
    ap.add_argument("--cache-size", type=int, default=d.cache_size, help="at most this many models held, least "
                    "recently used dropped first (default %(default)s)")
    ap.add_argument("--context", type=int, default=None, help="context limit (default: the training context)")
    ap.add_argument("--backend", default=d.backend, choices=["numpy", "numba", "cuda", "cuda-emu"],
                    help="default %(default)s")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for the kernels and BLAS (default: every core)")
    ap.add_argument("--activations", choices=["f32", "int8"], default=None,
                    help="the integer expert formats' GEMM activations on the numba backend (default int8; f32: exact; "
                         "see docs/speed.md)")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    a = ap.parse_args(argv)
    if not Path(a.model).is_dir():
        ap.error(f"--model {a.model}: no such directory (give a checkpoint directory or a UQFF bundle)")
    if a.cache_size < 1:
        ap.error("--cache-size must be at least 1")
    from toolkit.backend import resolve_backend
    from toolkit.errors import ToolkitError

    try:
        resolve_backend(a.backend)  # refused here, before serving, when it cannot run on this machine
        from toolkit.threads import set_threads

        set_threads(a.threads)
        if a.activations is not None:
            if a.activations != "f32" and a.backend != "numba":
                raise ToolkitError(f"--activations {a.activations} is a numba backend path (got --backend {a.backend})")
    except ToolkitError as e:
        ap.error(str(e))
    demo = build_app(AppSettings(model=a.model, output_root=a.output_root, cache_size=a.cache_size,
                                 backend=a.backend, context=a.context, activations=a.activations))
    demo.launch(server_name=a.host, server_port=a.port, show_error=False)


if __name__ == "__main__":
    main()
