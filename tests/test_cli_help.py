"""Every flag's documented default is the parser's own (``%(default)s``), and the format lists in the help come
from the registry: help text cannot drift from the code."""
from __future__ import annotations

import argparse
import re

import pytest

from toolkit.cli import build_parser
from toolkit.formats import FORMATS
from toolkit.quant.sensitivity import CANDIDATES
from toolkit.warmup import KV_ALL


def _app_parser():
    from app.__main__ import build_parser as app_parser

    return app_parser()


def _actions(parser: argparse.ArgumentParser, prog: str = ""):
    """(program, action) for every option of ``parser`` and of its subcommands."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, f"{prog} {name}".strip())
        elif not isinstance(a, argparse._HelpAction):
            yield prog, a


PARSERS = {"moqe": build_parser, "python -m app": _app_parser}
LITERAL_DEFAULT = re.compile(r"\bdefault\b[:\s]+(?!%\(default\)s)[-+]?\d")  # "default 16384" typed into a help


def _with_value_default(a: argparse.Action) -> bool:
    return (a.default not in (None, argparse.SUPPRESS) and not isinstance(a.default, bool)
            and a.nargs != 0 and not a.dest.startswith("_"))


@pytest.mark.parametrize("name", PARSERS)
def test_every_value_default_is_shown_from_the_parser(name):
    actions = list(_actions(PARSERS[name]()))
    assert len(actions) >= 8
    missing = [f"{prog} {a.option_strings or a.dest}" for prog, a in actions
               if _with_value_default(a) and "%(default)s" not in (a.help or "")]
    assert not missing, f"flags whose help does not show the parser's default: {missing}"
    typed = [f"{prog} {a.option_strings}: {a.help!r}" for prog, a in actions if LITERAL_DEFAULT.search(a.help or "")]
    assert not typed, f"defaults typed as numbers into the help (use %(default)s): {typed}"


def _help_of(prog: str, flag: str) -> str:
    for p, a in _actions(build_parser()):
        if p == prog and flag in a.option_strings:
            return " ".join((a.help % {"default": a.default}).split())
    raise AssertionError(f"no {flag} in moqe {prog}")


@pytest.mark.parametrize("prog", ["generate", "perplexity", "quantize", "export"])
def test_experts_help_lists_every_registered_quantized_format(prog):
    text = _help_of(prog, "--experts")
    names = [f.name for f in FORMATS.values() if f.quantized]
    assert len(names) >= 16
    for n in names:
        assert re.search(rf"\b{n}\b", text), f"--experts help of moqe {prog} lacks {n}: {text}"
    for g in sorted({g for f in FORMATS.values() for g in f.group_sizes}):
        assert str(g) in text


def test_list_defaults_come_from_the_code():
    assert ", ".join(CANDIDATES) in _help_of("plan", "--formats")
    assert ",".join(KV_ALL) in _help_of("warmup", "--kv-cache")
    rendered = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    from toolkit.quant.sensitivity import CALIBRATION_START

    assert f"default {CALIBRATION_START}" in " ".join(rendered.split())
