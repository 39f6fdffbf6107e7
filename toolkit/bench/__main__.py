"""Entry point: ``python -m toolkit.bench <suite> [options]``."""
from __future__ import annotations

import importlib
import sys

SUITES = {"formats": "toolkit.bench.formats", "quality": "toolkit.bench.quality", "kv": "toolkit.bench.kv",
          "moe": "toolkit.bench.moe", "runtime": "toolkit.bench.runtime", "cuda": "toolkit.bench.cuda",
          "uqff": "toolkit.bench.uqff", "memory": "toolkit.bench.memory", "anchors": "toolkit.bench.anchors", "layer": "toolkit.bench.layer",
          "plan": "toolkit.bench.plan", "coldstart": "toolkit.bench.coldstart",
          "gpu_check": "toolkit.bench.gpu_check", "placement": "toolkit.bench.placement",
          "serve": "toolkit.bench.serve", "probe": "toolkit.bench.probe", "ep": "toolkit.bench.ep"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        print(f"usage: python -m toolkit.bench {{{','.join(SUITES)}}} [options]   (each suite takes --help)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    importlib.import_module(SUITES[argv[0]]).run(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
