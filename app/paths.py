"""Confine user-given bundle paths to the output root (no absolute paths elsewhere, no ``..``, no symlink escapes)."""
from __future__ import annotations

from pathlib import Path

from toolkit.uqff import is_bundle

from .configs import InputError

MAX_NAME_CHARS = 1000


def under_root(root, name) -> Path:
    """``name`` (relative to ``root``) -> the resolved path, refused unless it lies strictly inside ``root``."""
    name = str(name or "").strip()
    if not name:
        raise InputError("give a bundle directory name under the output root")
    if len(name) > MAX_NAME_CHARS or any(ord(c) < 32 or c == "\x7f" for c in name):
        raise InputError(f"a bundle name has at most {MAX_NAME_CHARS} printable characters (no NUL or control characters)")
    if any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in Path(name).parts):
        raise InputError("each folder name in the bundle path is limited to 255 bytes")
    root = Path(root).resolve()
    p = Path(name)
    target = (p if p.is_absolute() else root / p).resolve()  # resolve() follows symlinks, so escapes show
    if target == root:
        raise InputError(f"{name!r} is the output root itself; give a folder name inside it")
    if not target.is_relative_to(root):
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
