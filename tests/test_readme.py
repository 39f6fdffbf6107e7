"""Docs that run: every ```python block of the README executes without error."""
import re
from pathlib import Path

import pytest

BLOCKS = re.findall(r"```python\n(.*?)```", (Path(__file__).resolve().parents[1] / "README.md").read_text(), re.S)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_python_block_runs(i):
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), {})


def test_readme_has_python_blocks():
    assert BLOCKS
