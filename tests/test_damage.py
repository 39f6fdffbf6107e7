"""Issue 18's table-driven damage test: one test per input kind, one row per damaged input (tests/damage/cases.py).

Each row builds its damaged input from fixtures made once per module (a tiny Mixtral checkpoint and UQFF
bundles quantized from it), runs ``moqe`` (``toolkit.cli.main``) or an app handler in this process, and is
judged as the campaign (tests/damage/campaign.py) judges a subprocess:

- a BAD row exits 2 with exactly one line on stderr (progress bars aside) that matches the row's message;
- a VALID row exits 0; an EITHER row does one of the two; none prints a traceback or an internal error;
- every file the row protects is unchanged (sha256); no planted outside file is opened (audit hook, access
  time); each command finishes within ``inprocess.TIMEOUT`` seconds (a FIFO never blocks) and its memory
  stays bounded; no command writes outside its case folder (a write there is stopped before it happens).

Select one kind with ``-k test_checkpoint`` (``test_bundle``, ``test_cli``, ``test_save``, ``test_app``) and a
row by its id, e.g. ``-k "test_checkpoint and index"``.
"""
from __future__ import annotations

import re

import pytest

from damage import campaign, inprocess
from damage import cases as C


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> C.Fixtures:
    return inprocess.build_fixtures(tmp_path_factory.mktemp("damage-fixtures"))


def check(case: C.Case, fx: C.Fixtures, folder) -> None:
    r = inprocess.run_case(case, fx, folder)
    lines = campaign.message_lines(r.proc.stderr)
    shown = f"{case.kind}/{case.id}: {r.outcome} - {r.summary}\n--- stderr:\n{r.proc.stderr[-3000:]}"
    assert r.outcome in case.expect, shown
    if case.expect == C.BAD:
        assert r.proc.rc == 2, shown
        assert len(lines) == 1, f"more than one line on stderr:\n{shown}"
        assert re.search(case.message, lines[0]), f"the message does not match {case.message!r}:\n{shown}"


def rows(kind: str):
    return pytest.mark.parametrize("case", C.TABLES[kind], ids=lambda c: c.id)


@rows("checkpoint")  # config.json, generation_config.json, tokenizer(_config).json, safetensors header and data, index
def test_checkpoint(case, fx, tmp_path):
    check(case, fx, tmp_path)


@rows("bundle")  # UQFF report, shards, residual, assets
def test_bundle(case, fx, tmp_path):
    check(case, fx, tmp_path)


@rows("cli")  # CLI flags
def test_cli(case, fx, tmp_path):
    check(case, fx, tmp_path)


@rows("save")  # quantize --out: where a bundle may be written, interrupted saves
def test_save(case, fx, tmp_path):
    check(case, fx, tmp_path)


@rows("app")  # app parameters
def test_app(case, fx, tmp_path):
    check(case, fx, tmp_path)


def test_every_bad_row_names_its_message():
    for c in C.CASES:
        assert c.expect != C.BAD or c.message, f"{c.kind}/{c.id}: a BAD row needs its expected message"
        if c.message:
            re.compile(c.message)


# ---- issue 29: the write rule and the read rule, tables generated from the CLI's declared arguments ------------
from damage import targets as T  # noqa: E402


@pytest.mark.parametrize("case", T.WRITE, ids=lambda c: c.id)
def test_write_targets(case, fx, tmp_path):
    check(case, fx, tmp_path)


@pytest.mark.parametrize("case", T.READ, ids=lambda c: c.id)
def test_read_inputs(case, fx, tmp_path):
    check(case, fx, tmp_path)


def test_generated_tables_cover_every_declared_argument():
    """Each declared target gets every write variant, each declared input every read variant (counts in the
    closing note of issue 29)."""
    writes, reads = T.declared()
    assert {(c, f) for c, f, _, _ in writes} == {("plan", "--out"), ("plan", "--sensitivity"), ("export", "--gguf"),
                                               ("quantize", "--out"), ("trace", "--out")}
    for cmd, flag, _, _ in writes:
        assert sum(c.id.startswith(f"{cmd}{flag}-") for c in T.WRITE) >= 10, (cmd, flag)
    for cmd, flag, _, _ in reads:
        assert sum(c.id.startswith(f"{cmd}{flag}-") for c in T.READ) >= 4, (cmd, flag)
    assert len(reads) >= 12


@pytest.mark.parametrize("case", T.FINDINGS, ids=lambda c: c.id)
def test_issue29_findings(case, fx, tmp_path):
    check(case, fx, tmp_path)
