"""Confine user-given bundle paths to the output root (no absolute paths elsewhere, no ``..``, no symlink escapes)."""
from __future__ import annotations

from pathlib import Path

from toolkit.uqff import is_bundle

from .configs import InputError


def under_root(root, name) -> Path:
    """``name`` (relative to ``root``) -> the resolved path, refused unless it lies strictly inside ``root``."""
    name = str(name or "").strip()
    if not name:
        raise InputError("give a bundle directory name under the output root")
    root = Path(root).resolve()
    p = Path(name)
    target = (p if p.is_absolute() else root / p).resolve()  # resolve() follows symlinks, so escapes show
    if target == root or not target.is_relative_to(root):
        raise InputError(f"{name!r} is outside the output root {root}; give a directory inside it")
    return target


def bundle_under_root(root, name) -> Path:
    target = under_root(root, name)
    if not is_bundle(target):
        raise InputError(f"no UQFF bundle at {target}")
    return target


def list_bundles(root) -> list[str]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(str(p.relative_to(root)) for p in root.iterdir() if p.is_dir() and is_bundle(p))
