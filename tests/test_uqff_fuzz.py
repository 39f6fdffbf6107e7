"""Fuzz: mutate header and data bytes of a small bundle; every load either succeeds with the same logits
or raises the toolkit's error type (never a crash, a hang or a silently different model).

Header mutations are loaded with and without the CRC pass (``verify``), so the structural checks are
exercised on their own; data mutations with it (without checksums a changed weight byte is, by design,
a changed weight). The number of cases run is printed (``pytest -s``) and bounded by FUZZ_CASES.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_uqff_support import build, logits, tiny_checkpoint
from toolkit.errors import ToolkitError
from toolkit.quant import parse_policy
from toolkit.uqff import load_bundle, spec

FUZZ_CASES = int(os.environ.get("UQFF_FUZZ_CASES", "150"))
POLICY = parse_policy("all-linear", "int3-g32", ["down=q4_0", "attn.o=fp8"])
_STATE: dict = {}
OUTCOMES: Counter = Counter()


def _base() -> tuple[Path, np.ndarray, list[str]]:
    if not _STATE:
        root = Path(tempfile.mkdtemp(prefix="uqff_fuzz_"))
        ckpt = tiny_checkpoint(root / "ckpt")
        build(ckpt, root / "bundle", POLICY, shard_bytes=32 * 1024)
        files = sorted(p.name for p in (root / "bundle").iterdir() if p.suffix in (".uqff", ".safetensors"))
        _STATE.update(root=root, bundle=root / "bundle", ref=logits(load_bundle(root / "bundle")[0]),
                      files=files + [spec.REPORT])
    return _STATE["bundle"], _STATE["ref"], _STATE["files"]


mutation = st.fixed_dictionaries({
    "file": st.integers(0, 1 << 16), "region": st.sampled_from(["header", "header", "data"]),
    "edits": st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4),
    "verify": st.booleans(), "truncate": st.sampled_from([None, None, None, 0.5, 0.99]),
})


@settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(m=mutation)
def test_fuzz_mutated_bundle(m):
    bundle, ref, files = _base()
    work = Path(tempfile.mkdtemp(prefix="case_", dir=_STATE["root"]))
    try:
        b = work / "b"
        shutil.copytree(bundle, b)
        name = files[m["file"] % len(files)]
        raw = bytearray((b / name).read_bytes())
        if name.endswith(".json"):
            lo, hi, verify = 0, len(raw), True
        else:
            n = 8 + int.from_bytes(raw[:8], "little")
            lo, hi = (0, n) if m["region"] == "header" else (n, len(raw))
            verify = m["verify"] or m["region"] == "data"
        for pos, xor in m["edits"]:
            raw[lo + int(pos * (hi - lo))] ^= xor
        if m["truncate"] is not None:
            raw = raw[: int(len(raw) * m["truncate"])]
        (b / name).write_bytes(bytes(raw))
        try:
            model, _ = load_bundle(b, verify=verify)
        except ToolkitError as e:
            OUTCOMES["rejected"] += 1
            assert str(b) in str(e)  # names the bundle's file
            return
        np.testing.assert_array_equal(logits(model), ref)  # loaded: then it is the same model
        OUTCOMES["loaded-identical"] += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def teardown_module(module):
    total = sum(OUTCOMES.values())
    print(f"\nUQFF fuzz: {total} cases ({dict(OUTCOMES)})")
    if _STATE:
        shutil.rmtree(_STATE["root"], ignore_errors=True)
