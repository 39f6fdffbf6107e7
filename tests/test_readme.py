"""Docs that run: every ```python block of the README and of ``docs/*.md`` executes without error, every ``moqe``
command in them parses with the CLI's own parser, every ``python -m toolkit.bench`` command names a suite and only
flags that suite takes, and every relative link points at a file that exists."""
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {p.relative_to(ROOT).as_posix(): p.read_text() for p in DOCS}

BLOCKS = [(name, i, code) for name, text in TEXT.items()
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, re.S))]


def _commands(prefix: str) -> list[tuple[str, str, bool]]:
    """(doc, command, whole) for each command line starting with ``prefix``: in code blocks (backslash
    continuations joined, ``#`` comments cut; ``whole``: a full invocation) and in inline code spans (a mention:
    its words must exist, its required flags may be left out). A line with ``...`` is an excerpt."""
    found = []
    for name, text in TEXT.items():
        for block in re.findall(r"```(?:bash|sh|)\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s#.*$", "", line).strip()
                if line.startswith(prefix) and "..." not in line:
                    found.append((name, line, True))
        for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            if span.startswith(prefix) and "..." not in span:
                found.append((name, span, False))
    return sorted(set(found))


MOQE = _commands("moqe ")
BENCH = _commands("python -m toolkit.bench ")
LINKS = sorted({(name, target) for name, text in TEXT.items()
                for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in target})


@pytest.mark.parametrize("name,i,code", BLOCKS, ids=[f"{n}:{i}" for n, i, _ in BLOCKS])
def test_doc_python_block_runs(name, i, code):
    exec(compile(code, f"{name} block {i}", "exec"), {})


def _subcommands() -> dict:
    import argparse

    from toolkit.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("name,line,whole", MOQE, ids=[f"{n}:{line[:60]}" for n, line, _ in MOQE])
def test_doc_moqe_command_parses(name, line, whole):
    from toolkit.cli import build_parser

    words = shlex.split(line)[1:]
    if whole:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(words)
        except SystemExit:
            pytest.fail(f"{name}: `{line}` does not parse: {err.getvalue().strip()}")
        return
    subs = _subcommands()
    assert words[0] in subs, f"{name}: `{line}`: moqe has no command {words[0]!r}"
    known = {s for a in subs[words[0]]._actions for s in a.option_strings}
    unknown = [w.split("=")[0] for w in words[1:] if w.startswith("--") and w.split("=")[0] not in known]
    assert not unknown, f"{name}: `{line}`: moqe {words[0]} takes no {unknown}"


def _bench_help(suite: str) -> str:
    import importlib

    from toolkit.bench.__main__ import SUITES

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(SUITES[suite]).run(["--help"])
    return out.getvalue()


@pytest.mark.parametrize("name,line,whole", BENCH, ids=[f"{n}:{line[:70]}" for n, line, _ in BENCH])
def test_doc_bench_command_names_real_flags(name, line, whole):
    from toolkit.bench.__main__ import SUITES

    words = shlex.split(line)[3:]
    if not words and not whole:
        return  # a mention of the entry point itself, which lists the suites
    assert words and words[0] in SUITES, f"{name}: `{line}` names no suite of {sorted(SUITES)}"
    helptext = _bench_help(words[0])
    flags = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
    unknown = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", helptext)]
    assert not unknown, f"{name}: `{line}`: bench {words[0]} takes no {unknown}"


@pytest.mark.parametrize("name,target", LINKS, ids=[f"{n}->{t}" for n, t in LINKS])
def test_doc_link_points_at_a_file(name, target):
    assert ((ROOT / name).parent / target).exists(), f"{name} links to {target}, which does not exist"


def test_docs_have_what_the_tests_read():
    assert BLOCKS and MOQE and BENCH and LINKS
    assert len(TEXT["README.md"].encode()) <= 10 * 1024, "the README is a front door: at most 10 KB"
