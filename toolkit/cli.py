"""The ``moqe`` command line. Each subcommand is one small function; heavy imports happen inside it."""
from __future__ import annotations

import argparse
import sys

from .errors import ToolkitError


def cmd_formats(args) -> int:
    """List the format registry: bits, group sizes, stored bits per weight, on-disk tag."""
    from .bench.timing import print_table
    from .formats import FORMATS

    rows = []
    for f in FORMATS.values():
        groups = ",".join(map(str, f.group_sizes)) if f.group_sizes else (str(f.group_size) if f.group_size else "per row")
        rows.append({"format": f.name, "bits": f.bits, "group sizes": groups, "default": f.spec,
                     "bits/weight (K=4096)": round(f.bits_per_weight((4096, 4096)), 4), "tag": f.tag, "description": f.doc})
    print_table(rows, "quantization formats")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moqe", description="MoQE Toolkit: MoE inference with quantized experts, no framework.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("formats", help="list the quantization formats")
    p.set_defaults(func=cmd_formats)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ToolkitError as e:
        print(f"moqe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
