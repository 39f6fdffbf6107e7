"""The one write rule. Every command and the app write through it; nothing else decides what may be replaced.

A target (a file or a bundle folder) is written only if

1. it is not inside or over any input of the same command: the source model folder (and everything in it,
   including what its files link to), a model file, a plan, a text, a table. ``--force`` never lifts this;
2. it is absent, or it was written by this toolkit and verifies as such (:data:`KINDS`: a plan file starts
   with its mark, a JSON table and a safetensors sidecar carry ``writer: moqe-toolkit``, a GGUF file carries
   ``general.quantized_by = moqe-toolkit``; a bundle's report lists exactly its files, each a regular file of
   the listed size and CRC); ``force=True`` (the CLI's ``--force``) replaces a plain file that does not verify;
3. it is not a symbolic link, a folder (for a file target), or anything but a regular file.

Writes are atomic (:func:`publish`): every file of one command is written to a temporary file beside its
target first, fsynced, and only when all are complete are they renamed into place; on any error (a full disk
included) the temporaries are removed, no target is touched, and the error says that nothing was replaced.
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .errors import ToolkitError
from .files import _boundary  # a hub snapshot's boundary is its repository folder (files link into blobs/)

WRITER = "moqe-toolkit"  # the mark every file this toolkit writes carries
PLAN_MARK = "# moqe plan"  # the first line of every plan file (CLI and app)


class WriteError(ToolkitError):
    """A target the write rule refuses, or a write that failed (nothing was replaced; ``reason``: the OS's word)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


# ---- what "written by this toolkit" means, per kind of file ---------------------------------------------------
def _head(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _is_plan(path: Path) -> bool:
    return _head(path, len(PLAN_MARK)).decode("utf-8", "replace") == PLAN_MARK


def _is_json_table(path: Path) -> bool:
    if os.stat(path).st_size > 256 * 1024 * 1024:
        return False
    try:
        d = json.loads(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(d, dict) and d.get("writer") == WRITER


def _is_safetensors(path: Path) -> bool:
    head = _head(path, 8)
    if len(head) < 8:
        return False
    n = struct.unpack("<Q", head)[0]
    if not 2 <= n <= min(1 << 24, os.stat(path).st_size - 8):
        return False
    try:
        h = json.loads(_head(path, 8 + n)[8:])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(h, dict) and isinstance(h.get("__metadata__"), dict) and h["__metadata__"].get("writer") == WRITER


def _is_gguf(path: Path) -> bool:
    if _head(path, 4) != b"GGUF":
        return False
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path), "r").get_field("general.quantized_by")
        return field is not None and str(field.contents()).startswith(WRITER)
    except Exception:  # noqa: BLE001 - any damage: not verifiably ours
        return False


@dataclass(frozen=True)
class Kind:
    name: str  # what the messages call it
    ours: Callable[[Path], bool]  # a regular file at the path was written by this toolkit (and verifies)


KINDS = {"plan": Kind("plan file", _is_plan), "table": Kind("sensitivity table", _is_json_table),
         "imatrix": Kind("importance file", _is_safetensors), "gguf": Kind("GGUF file", _is_gguf),
         "trace": Kind("routing trace", _is_safetensors)}


def _a(name: str) -> str:
    return ("an " if name[0] in "aeiou" else "a ") + name


# ---- the rule ------------------------------------------------------------------------------------------------
def _real(p: Path) -> Path:
    try:
        return Path(os.path.realpath(p))
    except (OSError, RuntimeError, ValueError) as e:
        raise WriteError(f"{p}: cannot resolve ({e})") from None


def input_paths(p) -> list[Path]:
    """An input (a folder or a file) -> the real paths a target may not be inside or equal to: the input itself
    (a hub snapshot: its repository folder) and, for a folder, whatever its entries link to."""
    p = Path(p)
    real = _real(p)
    out = [_boundary(real) if real.is_dir() else real]
    if real.is_dir():
        try:
            for e in os.scandir(real):
                if e.is_symlink():
                    out.append(_real(Path(e.path)))
        except OSError:
            pass
    return out


def check_not_input(target, inputs: Iterable, what: str) -> None:
    """Refuse ``target`` when it is, lies inside or contains an input. ``inputs``: paths, or (path, role) pairs
    where the role names the input in the message ("the source checkpoint"); None entries are skipped."""
    t = _real(Path(target))
    for inp in inputs:
        inp, role = inp if isinstance(inp, tuple) else (inp, None)
        if inp is None or not str(inp):
            continue
        for real in input_paths(inp):
            folder = real.is_dir()
            name = role or ("the input folder" if folder else "the input file")
            shown = f"{name} {inp}" if _real(Path(inp)) == real else f"{name} {inp} (its link to {real})"
            if t == real or (os.path.lexists(target) and os.path.lexists(real) and _same(target, real)):
                raise WriteError(f"{target}: is {shown}; write the {what} "
                                 f"{'to a separate folder' if folder else 'elsewhere'}")
            if folder and t.is_relative_to(real):
                raise WriteError(f"{target}: lies inside {shown}; write the {what} to a separate folder")
            if real.is_relative_to(t):
                raise WriteError(f"{target}: contains {shown}; write the {what} to a separate folder")


def _same(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_file_target(target, kind: str, inputs: Iterable = (), force: bool = False, flag: str = "the output") -> Path:
    """The write rule for one file: -> the target's Path, or :class:`WriteError` naming what is wrong."""
    if target is None or not str(target).strip():
        raise WriteError(f"{flag} is empty; give a file name to write")
    p = Path(target)
    k = KINDS[kind]
    check_not_input(p, inputs, k.name)
    if _plain_target(p, k.name) and not force:
        try:
            ours = k.ours(p)
        except OSError:
            ours = False
        if not ours:
            raise WriteError(f"{p}: exists and is not {_a(k.name)} written by this toolkit; refusing to replace it "
                             f"(give another name, or pass --force to replace it)")
    return p


def check_append_target(target, what: str = "table of rows") -> Path:
    """Rule 3 for a file a bench appends rows to as it measures them (``--rows``: appended, not published whole, so
    that a run cut by a time limit keeps every row it finished): not a symbolic link, a folder or anything but a
    regular file, in a folder that exists. -> the target's Path, or :class:`WriteError`."""
    p = Path(target)
    _plain_target(p, what)
    return p


def _plain_target(p: Path, what: str) -> bool:
    """Rule 3 for file target ``p`` (a symbolic link, a folder, anything but a regular file, a missing parent
    folder: :class:`WriteError`); returns whether ``p`` exists."""
    if os.path.islink(p):
        raise WriteError(f"{p}: is a symbolic link; give the real path of the {what} (nothing was written)")
    exists = os.path.lexists(p)
    if exists:
        try:
            st = os.stat(p)
        except OSError as e:
            raise WriteError(f"{p}: cannot read ({e.strerror or e})") from None
        if stat.S_ISDIR(st.st_mode):
            raise WriteError(f"{p}: is a folder; give the file name of the {what} to write")
        if not stat.S_ISREG(st.st_mode):
            raise WriteError(f"{p}: exists and is not a regular file; refusing to replace it")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise WriteError(f"{parent}: no such folder to write {p.name} into")
    return exists


# ---- atomic publication of a command's files -------------------------------------------------------------------
def publish(files: dict, mode: int = 0o666) -> None:
    """``files {target Path: write(tmp_path)}``: each writer fills a temporary file beside its target; only when
    every one is complete and fsynced are they renamed into place (mode ``mode``, like any file a user writes).
    On any error every temporary file is removed and no target is touched."""
    staged: list[tuple[str, Path]] = []
    try:
        for target, write in files.items():
            target = Path(target)
            parent = target.parent if str(target.parent) else Path(".")
            try:
                fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{target.name}.", suffix=".tmp")
            except OSError as e:
                raise WriteError(f"{target}: cannot write there ({e.strerror or e}); nothing was replaced") from None
            os.close(fd)
            staged.append((tmp, target))
            try:
                write(Path(tmp))
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.chmod(tmp, mode & ~_umask())
            except (OSError, WriteError) as e:  # a writer's own atomic write names our temporary file: name the target
                reason = e.reason if isinstance(e, WriteError) else e.strerror or e
                raise WriteError(f"{target}: writing failed ({reason}); nothing was replaced", reason) from None
        for tmp, target in staged:
            os.replace(tmp, target)
        for parent in {t.parent for _, t in staged}:
            _fsync_dir(parent if str(parent) else Path("."))
    except BaseException:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` would change it for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb"):
    """``with atomic_write(path) as f: f.write(...)``: the file appears whole or not at all (a temporary file
    beside it, fsynced, then renamed over it, with the mode any file the user writes gets; on any error the
    temporary file is removed and ``path`` is untouched, and a failed write, such as a full disk, is a
    :class:`WriteError` saying nothing was replaced). A folder at ``path`` is refused. Whether
    ``path`` may be replaced at all is the caller's question (:func:`check_file_target`)."""
    path = Path(path)
    if path.is_dir():
        raise WriteError(f"{path}: is a folder; give a file name")
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise WriteError(f"{path}: cannot write there ({e.strerror or e}); nothing was replaced") from None
    try:
        try:
            with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        except OSError as e:
            raise WriteError(f"{path}: writing failed ({e.strerror or e}); nothing was replaced", e.strerror) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (:func:`atomic_write`)."""
    with atomic_write(path, "w") as f:
        f.write(text)
