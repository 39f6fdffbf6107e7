"""Reading what a user points at, and nothing else: files resolved inside one folder, regular files only,
JSON parsed with bounds. Every refusal is a :class:`~toolkit.errors.ModelError` naming the file.

- A name from inside a file (a shard in an index, a file in a bundle report) is a relative path with no
  ``..`` and no absolute part, and after symlinks it must still lie inside the folder. The one exception
  is the Hugging Face hub cache, whose ``models--X/snapshots/<rev>/`` files link into ``models--X/blobs/``:
  there the repository folder ``models--X`` is the boundary. ``allow_outside=True`` (the CLI's
  ``--allow-outside``) lifts the rule for users who keep shards elsewhere on purpose.
- Only regular files are opened: a FIFO, a device or a directory named ``*.safetensors`` is refused
  before ``open`` (which would block on a FIFO forever).
- JSON: at most ``max_bytes``, UTF-8, no ``NaN``/``Infinity`` constants, nesting at most ``max_depth``
  (checked on the bytes before the parser recurses), and the top-level type the caller expects.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np

from .errors import ModelError

MAX_JSON_BYTES = 64 * 1024 * 1024


def _boundary(folder: Path) -> Path:
    """The folder whose inside a file may resolve to (the repository folder for a hub-cache snapshot)."""
    parts = folder.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith(("models--", "datasets--")):
        return Path(*parts[:-2])
    return folder


def check_name(name: str, where: str) -> None:
    """A relative file name with no ``..``, no absolute part, no NUL (names inside an index or report)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelError(f"{where}: bad file name {name!r}")
    p = Path(name)
    if p.is_absolute() or ".." in p.parts or name.startswith("~"):
        raise ModelError(f"{where}: file name {name!r} points outside the folder (only plain relative names are read)")


def check_regular(path: Path, what: str = "file") -> os.stat_result:
    """stat() a path (following links) and refuse anything but a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelError(f"{path}: no such {what}") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket or special file")
        raise ModelError(f"{path}: is {kind}, not a regular {what}")
    return st


class Folder:
    """A model or bundle folder: ``path(name)`` resolves a file inside it, ``json(name)`` reads one."""

    def __init__(self, directory, allow_outside: bool = False):
        self.dir = Path(directory)
        self.allow_outside = allow_outside
        if not str(directory):
            raise ModelError("the model folder is an empty string; give a folder path")
        try:
            is_dir, exists = self.dir.is_dir(), os.path.lexists(self.dir)
        except OSError as e:
            raise ModelError(f"{self.dir}: cannot read ({e.strerror or e})") from None
        if not exists:
            raise ModelError(f"{self.dir}: no such folder")
        if not is_dir:
            raise ModelError(f"{self.dir}: is a file, not a folder")
        self.root = _boundary(self.dir.resolve())

    def path(self, name: str, where: str | None = None, what: str = "file") -> Path:
        """The path of ``name`` inside the folder, checked: inside after symlinks, a regular file."""
        check_name(name, where or str(self.dir))
        p = self.dir / name
        if not self.allow_outside:
            try:
                real = p.resolve()
            except (OSError, RuntimeError) as e:  # a symlink loop
                raise ModelError(f"{p}: cannot resolve ({e})") from None
            if not real.is_relative_to(self.root):
                raise ModelError(f"{p}: resolves to {real}, outside {self.dir} (a symlink leaving the folder; "
                                 f"pass --allow-outside to read it anyway)")
        check_regular(p, what)
        return p

    def exists(self, name: str) -> bool:
        """Whether the folder holds an entry of that name (a link, a FIFO, anything)."""
        return os.path.lexists(self.dir / name)

    def json(self, name: str, expect: type = dict, max_bytes: int = MAX_JSON_BYTES, max_depth: int = 32):
        return read_json(self.path(name), expect, max_bytes, max_depth)


def json_type(v) -> str:
    """A JSON value's kind as JSON names it ('a string', 'null', ...), for messages."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list) -> dict:
    """An object whose keys are unique (JSON parsers differ on duplicates: we refuse them)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice in one object")
    return out


def json_depth(data: bytes) -> int:
    """Maximum nesting of ``[`` / ``{`` outside strings (computed without recursion)."""
    stripped = re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', data)
    b = np.frombuffer(stripped, np.uint8)
    step = np.isin(b, (ord("["), ord("{"))).astype(np.int64) - np.isin(b, (ord("]"), ord("}"))).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


def parse_json(data: bytes, where, expect: type = dict, max_depth: int = 32):
    """Bytes -> a JSON value of type ``expect``; ModelError naming ``where`` otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"{where}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    depth = json_depth(data)
    if depth > max_depth:
        raise ModelError(f"{where}: JSON nested {depth} levels deep (at most {max_depth} expected)")
    try:
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise ModelError(f"{where}: not valid JSON ({e})") from None
    if expect is not None and not isinstance(value, expect):
        want = {dict: "a JSON object", list: "a JSON list"}.get(expect, expect.__name__)
        raise ModelError(f"{where}: expected {want}, found {json_type(value)}")
    return value


def read_json(path: Path, expect: type = dict, max_bytes: int = MAX_JSON_BYTES, max_depth: int = 32):
    st = check_regular(path)
    if st.st_size > max_bytes:
        raise ModelError(f"{path}: {st.st_size:,} bytes, more than the {max_bytes:,} a JSON file of this kind may have")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_json(data, path, expect, max_depth)


def read_text(path, what: str = "text file", max_bytes: int = 1 << 30) -> str:
    """A UTF-8 text file the user named (``perplexity --text``): regular, bounded, decodable."""
    path = Path(path)
    st = check_regular(path, what)
    if st.st_size > max_bytes:
        raise ModelError(f"{path}: {st.st_size:,} bytes, more than {max_bytes:,}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
                         f"give a plain text file") from None
