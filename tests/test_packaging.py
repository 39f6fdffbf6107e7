"""Packaging: pyproject.toml and environment.yml name the same packages with the same bounds; the CLI runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"torch": "pytorch", "prometheus-client": "prometheus_client", "ray": "ray-core"}  # PyPI name -> conda-forge name where they differ


def _pyproject_requirements() -> dict[str, SpecifierSet]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"]) + list(meta["optional-dependencies"]["test"])
    out = {}
    for r in map(Requirement, reqs):
        out[CONDA_NAMES.get(r.name.lower(), r.name.lower())] = r.specifier
    return out


def _environment_requirements() -> dict[str, SpecifierSet]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    out = {}
    for dep in env["dependencies"]:
        if not isinstance(dep, str):
            continue
        m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", dep.strip())
        name, spec = m.group(1).lower(), m.group(2).replace(" ", "")
        if name not in ("python", "pip"):
            out[name] = SpecifierSet(spec)
    return out


def test_environment_yml_mirrors_pyproject():
    py, env = _pyproject_requirements(), _environment_requirements()
    assert sorted(py) == sorted(env), f"package sets differ: only pyproject {set(py) - set(env)}, only env {set(env) - set(py)}"
    for name, spec in py.items():
        assert spec == env[name], f"{name}: pyproject {spec} != environment.yml {env[name]}"


def test_the_test_extra_holds_the_dist_extra():
    """CI installs the test extra: every package of the dist extra is in it with the same bounds, so the
    expert-parallel tests (tests/test_dist.py) run against what `pip install -e .[dist]` gives a user."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    test = {r.name: r.specifier for r in map(Requirement, extras["test"])}
    for r in map(Requirement, extras["dist"]):
        assert test.get(r.name) == r.specifier, f"{r.name}: dist {r.specifier}, test {test.get(r.name)}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash .ci/test" in readme and "bash .ci/main" in readme
    assert "exec bash .ci/test" in (ROOT / ".ci/run").read_text()


def test_cli_help_and_formats():
    out = subprocess.run([sys.executable, "-m", "toolkit", "--help"], capture_output=True, text=True, check=True).stdout
    assert "formats" in out
    out = subprocess.run([sys.executable, "-m", "toolkit", "formats"], capture_output=True, text=True, check=True).stdout
    for name in ("int8", "fp8", "int4-g64", "int3", "int2", "q8_0", "q4_0", "bf16"):
        assert name in out


def test_model_package_does_not_import_the_bundle_format():
    """``toolkit.model`` (the runtime) sits below ``toolkit.uqff`` (bundles), and ``toolkit.load`` above both:
    importing the runtime loads nothing of the bundle code (no import circle)."""
    import subprocess
    import sys

    code = "import sys, toolkit.model; print(sorted(m for m in sys.modules if m.startswith(('toolkit.uqff', 'toolkit.load', 'toolkit.sources'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


# Every entry point sets OpenBLAS's idle-thread timeout before NumPy (and so OpenBLAS) loads: read later, it is
# ignored, and OpenBLAS's spinning workers take the core the parallel expert GEMM needs (toolkit/threads.py).
_SPY = """
import importlib.abc, os, sys
seen = []
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "numpy" and not seen:
            seen.append(os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
        return None
sys.meta_path.insert(0, Spy())
import {module}
print(seen)
"""


@pytest.mark.parametrize("module", ["toolkit.load", "toolkit.bench.layer", "app"])
def test_openblas_timeout_is_set_before_numpy_loads(module):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run([sys.executable, "-c", _SPY.format(module=module)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['4']", out.stdout
