"""The damage tables of the campaign (issue 18): one row per damaged input, grouped by input kind.

A row is ``Case(id, kind, setup, expect, message)``. ``setup(ctx)`` builds the damaged input inside ``ctx.dir``
from the campaign's fixtures (a tiny Mixtral checkpoint and UQFF bundles written from it) and returns a
:class:`Run`: the arguments of ``moqe``, or a call of an app handler. ``expect`` holds the outcome
classes that count as good: ``clear-error`` for bad input, ``ok`` for valid input, both where either is
right. ``message`` (required for BAD rows) is a regular expression that the one error line must match
(``re.search``): it names what is wrong and what was expected, without the temp folder's path. What a setup
marks with ``ctx.protect`` must survive byte for byte; what it plants with
``ctx.outside`` / ``ctx.move_outside`` lies outside what the command names and must never be read.

Nothing here imports the toolkit: the files are damaged with plain JSON, struct and NumPy, so the
tables stay usable while the code under test is broken.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

BAD = ("clear-error",)  # bad input: a one-line error, rc 2
VALID = ("ok",)  # valid input: rc 0
EITHER = ("clear-error", "ok")  # odd but meaningful input: refusing it or running it correctly are both right

PROMPT = "It is"
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. " * 3
DROP = object()  # in a config change: remove the key
DEEP = 100_000  # nesting depth of the deeply nested JSON damages
LAYER = "model.layers.0.block_sparse_moe.experts.down_proj"  # the first layer of every bundle (shard model-0.uqff)
OTHER_LAYER = "model.layers.0.block_sparse_moe.experts.gate_proj"
# expected messages: the files they name, as the paths end (a message is matched with re.search)
L = re.escape(LAYER)
CONFIG_JSON = r"model/config\.json: "
ST = r"model/model\.safetensors: "
INDEX = r"model/model\.safetensors\.index\.json: "
REPORT = r"bundle/uqff_report\.json: "
SHARD0 = r"bundle/model-0\.uqff: "


# ---- what a row is ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # checkpoint, bundle, cli, save, app
    setup: Callable[["Ctx"], "Run"]
    expect: tuple  # the good outcome classes
    message: str | None = None  # for BAD rows: a regular expression the error line must match


@dataclass
class Run:
    """One command of a case: ``moqe ARGV`` (bytes allowed) or an app handler call."""

    argv: list | None = None
    app: dict | None = None  # {"handler": name, "args": [...], "settings": {...}}: see campaign.APP_DRIVER
    env: dict = field(default_factory=dict)
    then: list | None = None  # a follow-up ``moqe`` command whose outcome is the case's (after an interruption)
    isolate: bool = False  # run with every mount read-only but the case folder (for ``--out /``)


@dataclass
class Fixtures:
    """Built once per campaign (campaign.build_fixtures)."""

    code: Path  # the root of the code under test (toolkit/, app/, data/)
    tiny: Path  # tiny Mixtral, 4 experts, vocab 8192, with the bundled tokenizer and its JSON assets
    tiny8: Path  # the same with 8 experts
    tiny_v64: Path  # the same with vocab 64 (smaller than the tokenizer's 8192)
    bundle: Path  # moqe quantize --experts int4 of tiny (one shard)
    sharded: Path  # the same in three shards (--shard-size 20000)
    bundle_int2: Path  # moqe quantize --experts int2 of tiny

    @property
    def data_model(self) -> Path:
        return self.code / "data" / "model"

    @property
    def heldout(self) -> Path:
        return self.code / "data" / "heldout.txt"


class Ctx:
    """The case's temp folder plus what the runner must check after the command."""

    def __init__(self, directory: Path, fx: Fixtures):
        self.dir, self.fx = Path(directory), fx
        self.protected: list[Path] = []  # files (or folders of files) that must survive byte for byte
        self.outside: list[Path] = []  # files that must never be opened
        self.outside_only = False  # the only valid copy of a needed file lies outside: rc 0 means it was read
        self.readonly: list[Path] = []  # folders made unwritable (undone by the runner)
        self.mounts: list[Path] = []  # small tmpfs mounts (a full disk), unmounted by the runner
        self.listings: dict[Path, list] = {}  # folders whose entries must be exactly these afterwards (no leftovers)

    def copy(self, src: Path, name: str) -> Path:
        dst = self.dir / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, symlinks=True)
        return dst

    def tiny(self, name: str = "model", base: str = "tiny", changes: dict | None = None) -> Path:
        d = self.copy(getattr(self.fx, base), name)
        if changes:
            edit_json(d / "config.json", changes)
        return d

    def bundle(self, name: str = "bundle", base: str = "bundle") -> Path:
        return self.copy(getattr(self.fx, base), name)

    def text(self, content: str | bytes = TEXT, name: str = "text.txt") -> Path:
        p = self.dir / name
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        return p

    def protect(self, *paths) -> None:
        self.protected += [Path(p) for p in paths]

    def plant_outside(self, src: Path | bytes, name: str) -> Path:
        """A file outside every folder the command names; opening it is an escape."""
        p = self.dir / "outside" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, bytes):
            p.write_bytes(src)
        else:
            shutil.copyfile(src, p)
        self.outside.append(p)
        return p

    def move_outside(self, path: Path, link: bool = True) -> Path:
        """Move ``path`` out of its folder (a symlink left in its place): the only valid copy lies outside."""
        p = self.plant_outside(path, path.name)
        path.unlink()
        if link:
            path.symlink_to(p)
        self.outside_only = True
        return p

    def make_readonly(self, path: Path) -> None:
        self.readonly.append(Path(path))
        os.chmod(path, 0o555)
        if os.geteuid() == 0:  # root ignores modes: make the folder immutable instead
            os.system(f"chattr +i '{path}' 2>/dev/null")

    def full_disk(self, name: str, size: int) -> Path:
        """A tmpfs of ``size`` bytes at ``self.dir/name`` (root only): a disk that fills up."""
        import subprocess

        d = self.dir / name
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode:
            import pytest

            pytest.skip(f"cannot mount a small tmpfs to fill up ({r.stderr.strip() or r.returncode}): needs root")
        self.mounts.append(d)
        return d

    def exact(self, folder: Path) -> None:
        """After the command ``folder`` must hold exactly what it holds now (no temporary file left behind)."""
        self.listings[Path(folder)] = sorted(os.listdir(folder))

    def leftovers(self) -> list[str]:
        return [f"{d}: {sorted(set(os.listdir(d)) - set(want))}" for d, want in self.listings.items()
                if sorted(os.listdir(d)) != want]

    def release(self) -> None:
        """Undo ``make_readonly`` and ``full_disk`` (the runner calls this after the command)."""
        import subprocess

        for d in self.mounts:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        for d in self.readonly:
            if os.geteuid() == 0:
                os.system(f"chattr -i '{d}' 2>/dev/null")
            try:
                os.chmod(d, 0o755)
            except OSError:
                pass


# ---- plain file damage --------------------------------------------------------------------------------------
def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1))


def edit_json(path: Path, changes: dict) -> None:
    obj = json.loads(Path(path).read_text())
    for k, v in changes.items():
        if v is DROP:
            obj.pop(k, None)
        else:
            obj[k] = v
    write_json(path, obj)


def deep_json(depth: int = DEEP) -> bytes:
    """A JSON object with one member nested ``depth`` arrays deep (a parser's recursion bomb)."""
    return b'{"deep": ' + b"[" * depth + b"]" * depth + b"}"


def damage_file(ctx: Ctx, path: Path, damage) -> None:
    """Replace ``path`` (a file that may exist) by ``damage``: bytes or str (new content), ``"missing"``,
    ``"dir"``, ``"fifo"``, ``"outside"`` (moved out, a symlink left), ``"dev-zero"`` (a symlink to
    /dev/zero), or a callable(path)."""
    path = Path(path)
    if callable(damage):
        damage(path)
        return
    if damage == "outside":
        ctx.move_outside(path)
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if isinstance(damage, (bytes, str)) and damage not in ("missing", "dir", "fifo", "dev-zero"):
        path.write_bytes(damage.encode() if isinstance(damage, str) else damage)
    elif damage == "dir":
        path.mkdir()
        (path / "x").write_text("x")
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "dev-zero":
        path.symlink_to("/dev/zero")


def truncate(size) -> Callable[[Path], None]:
    """Cut a file to ``size`` bytes (an int, or a function of the current size)."""
    def cut(path: Path) -> None:
        n = size(path.stat().st_size) if callable(size) else size
        with open(path, "r+b") as f:
            f.truncate(n)
    return cut


def flip_byte(offset_from_end: int = 100) -> Callable[[Path], None]:
    def flip(path: Path) -> None:
        b = bytearray(path.read_bytes())
        b[-offset_from_end] ^= 0xFF
        path.write_bytes(bytes(b))
    return flip


# ---- safetensors, raw -----------------------------------------------------------------------------------------
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8}


def st_read(path: Path) -> tuple[dict, bytes]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + n]), raw[8 + n:]


def st_write(path: Path, header: dict | None, data: bytes, blob: bytes | None = None, length: int | None = None) -> None:
    """Write a header (or raw ``blob``) and a data section; ``length`` overrides the 8-byte header length."""
    blob = json.dumps(header, separators=(",", ":")).encode() if blob is None else blob
    blob += b" " * (-len(blob) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


def st_tensors(path: Path) -> tuple[dict, dict]:
    """-> ({name: [dtype, shape, bytes]} in file order, metadata)."""
    header, data = st_read(path)
    meta = header.pop("__metadata__", None)
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    return {k: [header[k]["dtype"], list(header[k]["shape"]),
                data[header[k]["data_offsets"][0]: header[k]["data_offsets"][1]]] for k in order}, meta


def st_save(path: Path, tensors: dict, meta=None) -> None:
    """Lay ``{name: [dtype, shape, bytes]}`` out sequentially (as a correct writer would)."""
    header = {"__metadata__": meta} if meta is not None else {}
    data = b""
    for name, (dtype, shape, b) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    st_write(path, header, data)


def as_array(entry) -> np.ndarray:
    dtype, shape, b = entry
    return np.frombuffer(b, DTYPES[dtype]).reshape(shape).copy()


def tensors_edit(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    """A damage that edits the tensors of a safetensors file (then writes it correctly laid out)."""
    def edit(path: Path) -> None:
        t, meta = st_tensors(path)
        fn(t)
        st_save(path, t, meta)
    return edit


def header_edit(fn: Callable[[dict, bytes], tuple | None]) -> Callable[[Path], None]:
    """A damage of the raw header: ``fn(header, data)`` edits in place or returns (header, data[, blob, length])."""
    def edit(path: Path) -> None:
        h, d = st_read(path)
        r = fn(h, d)
        st_write(path, *(r or (h, d)))
    return edit


def set_values(name: str, value) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        a = as_array(t[name])
        a.reshape(-1)[:4] = value
        t[name][2] = a.tobytes()
    return edit


def drop(*names: str) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        for n in names:
            del t[n]
    return edit


def entry(name: str, dtype=None, shape=None, data=None) -> Callable[[dict], None]:
    """Change one tensor's dtype, shape or bytes (the others kept)."""
    def edit(t: dict) -> None:
        e = t[name]
        t[name] = [dtype or e[0], e[1] if shape is None else shape, e[2] if data is None else data]
    return edit


def add_tensor(name: str, dtype: str, shape: list, data: bytes) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        t[name] = [dtype, shape, data]
    return edit


def neighbours(h: dict) -> tuple[str, str]:
    """The first tensor of at least 16 bytes and the one stored after it."""
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    i = next(i for i, k in enumerate(names) if h[k]["data_offsets"][1] - h[k]["data_offsets"][0] >= 16)
    return names[i], names[i + 1]


def overlap(h: dict, d: bytes) -> None:
    """A tensor starts 8 bytes inside the one stored before it."""
    a, b = neighbours(h)
    lo, hi = h[b]["data_offsets"]
    h[b]["data_offsets"] = [lo - 8, hi - 8]


def overlap_hidden_by_empty(h: dict, d: bytes) -> None:
    """As ``overlap``, with an empty tensor placed between them so that a check of neighbours misses it."""
    overlap(h, d)
    a, _ = neighbours(h)
    end = h[a]["data_offsets"][1]
    h["hide.empty"] = {"dtype": h[a]["dtype"], "shape": [0], "data_offsets": [end - 16, end - 16]}


def deep_header(h: dict, d: bytes) -> tuple:
    blob = deep_json()[:-1] + b"," + json.dumps(h, separators=(",", ":")).encode()[1:]
    return None, d, blob


def duplicate_key(h: dict, d: bytes) -> tuple:
    """A tensor appears twice in the header, the second time pointing at the next tensor's bytes."""
    a, b = neighbours(h)
    body = json.dumps(h, separators=(",", ":")).encode()[1:]
    twin = json.dumps({a: {**h[a], "data_offsets": h[b]["data_offsets"]}}, separators=(",", ":")).encode()[1:-1]
    return None, d, b"{" + twin + b"," + body


def header_length(value) -> Callable[[dict, bytes], tuple]:
    """Lie about the header length: ``value(real)`` replaces it."""
    def lie(h: dict, d: bytes) -> tuple:
        blob = json.dumps(h, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        return None, d, blob, value(len(blob))
    return lie


def shape_of(name: str, shape) -> Callable[[dict, bytes], None]:
    def edit(h: dict, d: bytes) -> None:
        h[name]["shape"] = shape
    return edit


def header_field(name: str, key: str, value) -> Callable[[dict, bytes], None]:
    def edit(h: dict, d: bytes) -> None:
        if value is DROP:
            del h[name][key]
        else:
            h[name][key] = value
    return edit


def overflow_extra(h: dict, d: bytes) -> None:
    """An extra tensor whose element count (2^64) wraps to 0 in int64: it claims no bytes."""
    h["overflow"] = {"dtype": "U8", "shape": [2**32, 2**32], "data_offsets": [0, 0]}


def overflow_used(name: str) -> Callable[[dict, bytes], None]:
    """A used tensor whose element count wraps to 0: [2^62, 4] claiming no bytes."""
    def edit(h: dict, d: bytes) -> None:
        lo = h[name]["data_offsets"][0]
        h[name].update(shape=[2**62, 4], data_offsets=[lo, lo])
    return edit


# ---- UQFF bundles ---------------------------------------------------------------------------------------------
def read_report(b: Path) -> dict:
    return json.loads((b / "uqff_report.json").read_text())


def refresh(b: Path) -> None:
    """Update the report's sizes and CRC-32s to the files as they are now (a damage that passes the CRC check)."""
    r = read_report(b)
    for name in r["files"]:
        p = b / name
        if p.is_file():
            data = p.read_bytes()
            r["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    write_json(b / "uqff_report.json", r)


def report_edit(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        r = json.loads(path.read_text())
        fn(r)
        write_json(path, r)
    return edit


def layer_entries(t: dict, key: str) -> dict:
    return {n: e for n, e in t.items() if n == key + ".weight" or n.startswith(key + ".weight.")}


def drop_layer(t: dict) -> None:
    """The first layer's entries removed from its shard."""
    for n in layer_entries(t, LAYER):
        del t[n]


def swap_layers(t: dict) -> None:
    """Two layers of one shape exchange their names (an undetectable swap: the layer table cannot tell)."""
    a, b = layer_entries(t, LAYER), layer_entries(t, OTHER_LAYER)
    t.update({n.replace(LAYER, OTHER_LAYER): e for n, e in a.items()})
    t.update({n.replace(OTHER_LAYER, LAYER): e for n, e in b.items()})


def move_layer(ctx: Ctx, b: Path) -> None:
    """A layer moves from shard 0 to shard 1: every tensor is still there, the report's layer table is not."""
    t0, m0 = st_tensors(b / "model-0.uqff")
    t1, m1 = st_tensors(b / "model-1.uqff")
    moved = layer_entries(t0, LAYER)
    st_save(b / "model-0.uqff", {n: e for n, e in t0.items() if n not in moved}, m0)
    st_save(b / "model-1.uqff", {**t1, **moved}, m1)


def copy_layer(ctx: Ctx, b: Path) -> None:
    """A layer of shard 0 also stored in shard 1."""
    t0, _ = st_tensors(b / "model-0.uqff")
    t1, m1 = st_tensors(b / "model-1.uqff")
    st_save(b / "model-1.uqff", {**t1, **layer_entries(t0, LAYER)}, m1)


def transplant_int2(ctx: Ctx, b: Path) -> None:
    """The first layer replaced by its int2 encoding from another bundle; the report still says int4."""
    t, meta = st_tensors(b / "model-0.uqff")
    t2, _ = st_tensors(ctx.fx.bundle_int2 / "model-0.uqff")
    for n in layer_entries(t, LAYER):
        del t[n]
    t.update(layer_entries(t2, LAYER))
    st_save(b / "model-0.uqff", t, meta)


def rename_layer(ctx: Ctx, b: Path) -> None:
    """The first layer's entries renamed to a layer the config does not have (layer 7)."""
    t, meta = st_tensors(b / "model-0.uqff")
    new = LAYER.replace("layers.0", "layers.7")
    st_save(b / "model-0.uqff", {n.replace(LAYER, new): e for n, e in t.items()}, meta)


def extra_shard(listed: bool) -> Callable[[Ctx, Path], None]:
    """A copy of shard 0 as model-1.uqff, listed in the report or not."""
    def add(ctx: Ctx, b: Path) -> None:
        shutil.copyfile(b / "model-0.uqff", b / "model-1.uqff")
        if listed:
            r = read_report(b)
            r["shards"].append({"file": "model-1.uqff", "bytes": 0, "layers": 0})
            r["files"]["model-1.uqff"] = {"bytes": 0, "crc32": 0}
            write_json(b / "uqff_report.json", r)
    return add


def shard_outside_listed(ctx: Ctx, b: Path) -> None:
    """The report names a shard by a path leading out of the bundle (the shard itself moved there)."""
    p = ctx.move_outside(b / "model-0.uqff", link=False)
    rel = os.path.relpath(p, b)
    r = read_report(b)
    r["shards"][0]["file"] = rel
    r["files"][rel] = r["files"].pop("model-0.uqff")
    write_json(b / "uqff_report.json", r)


def shard_absolute_listed(ctx: Ctx, b: Path) -> None:
    p = ctx.move_outside(b / "model-0.uqff", link=False)
    r = read_report(b)
    r["shards"][0]["file"] = str(p)
    r["files"][str(p)] = r["files"].pop("model-0.uqff")
    write_json(b / "uqff_report.json", r)


def asset_listed(name: str, content: bytes) -> Callable[[Ctx, Path], None]:
    """Add (or replace) a JSON asset and list it in the report."""
    def add(ctx: Ctx, b: Path) -> None:
        (b / name).write_bytes(content)
        r = read_report(b)
        r["files"][name] = {"bytes": 0, "crc32": 0}
        write_json(b / "uqff_report.json", r)
    return add


# ---- the commands ---------------------------------------------------------------------------------------------
def generate(ctx: Ctx, model: Path, *extra) -> Run:
    return Run(["generate", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", "2", *extra])


def info(ctx: Ctx, model: Path, *extra) -> Run:
    return Run(["info", "--model", str(model), *extra])


def inspect(ctx: Ctx, bundle: Path, *extra) -> Run:
    return Run(["uqff", "inspect", str(bundle), *extra])


def perplexity(ctx: Ctx, model: Path, *extra) -> Run:
    return Run(["perplexity", "--model", str(model), "--text", str(ctx.text()), "--max-tokens", "80", *extra])


def quantize(ctx: Ctx, model: Path, out, *extra) -> Run:
    return Run(["quantize", "--model", str(model), "--experts", "int4", "--out", str(out), *extra])


CMD = {"generate": generate, "info": info, "inspect": inspect, "perplexity": perplexity}


# ---- row factories --------------------------------------------------------------------------------------------
def ck(damage=None, file: str = "model.safetensors", cmd: str = "generate", base: str = "tiny", changes=None):
    """A tiny checkpoint with ``changes`` merged into config.json and ``damage`` applied to ``file``."""
    def setup(ctx: Ctx) -> Run:
        d = ctx.tiny(base=base, changes=changes)
        if damage is not None:
            damage_file(ctx, d / file, damage)
        return CMD[cmd](ctx, d)
    return setup


def cfg(cmd: str = "generate", base: str = "tiny", **changes):
    """A tiny checkpoint whose config.json has ``changes`` (``DROP`` removes a key)."""
    return ck(cmd=cmd, base=base, changes=changes)


def inf_expert_int4(ctx: Ctx) -> Run:
    """An inf in an expert weight, quantized to int4 as it loads."""
    d = ctx.tiny()
    damage_file(ctx, d / "model.safetensors", tensors_edit(set_values("model.layers.0.block_sparse_moe.experts.0.w1.weight", np.inf)))
    return generate(ctx, d, "--experts", "int4")


def ck_index(weight_map, cmd: str = "generate"):
    """The tiny checkpoint read through a ``model.safetensors.index.json``: ``weight_map(ctx, d, names)``
    returns the index's object (or raw bytes), ``names`` being the tensors of model.safetensors."""
    def setup(ctx: Ctx) -> Run:
        d = ctx.tiny()
        names = list(st_tensors(d / "model.safetensors")[0])
        index = weight_map(ctx, d, names)
        p = d / "model.safetensors.index.json"
        if isinstance(index, bytes):
            p.write_bytes(index)
        elif index is not None:
            write_json(p, index)
        return CMD[cmd](ctx, d)
    return setup


def every_tensor_in(shard_of: Callable[[Ctx, Path], str]):
    """weight_map: every tensor in the one shard ``shard_of(ctx, d)`` names."""
    def wm(ctx: Ctx, d: Path, names: list) -> dict:
        shard = shard_of(ctx, d)
        return {"metadata": {}, "weight_map": {n: shard for n in names}}
    return wm


def shard_outside_absolute(ctx: Ctx, d: Path) -> str:
    """The shard moved out of the folder, named by its absolute path."""
    return str(ctx.move_outside(d / "model.safetensors", link=False))


def shard_outside_relative(ctx: Ctx, d: Path) -> str:
    """The shard moved out of the folder, named by a path with ``..``."""
    return os.path.relpath(ctx.move_outside(d / "model.safetensors", link=False), d)


def shard_symlinked_outside(ctx: Ctx, d: Path) -> str:
    """The shard moved out of the folder, a symlink to it left in its place."""
    ctx.move_outside(d / "model.safetensors")
    return "model.safetensors"


def first_tensor_in(shard: str, make=None):
    """weight_map: the first tensor in ``shard`` (made by ``make(ctx, d)``), the others in model.safetensors.
    A ``shard`` that leads out of the folder is an outside file: opening it is an escape."""
    def wm(ctx: Ctx, d: Path, names: list) -> dict:
        if make:
            make(ctx, d)
        target = Path(os.path.normpath(d / shard))
        if not target.is_relative_to(d):
            ctx.outside.append(target)
        return {"weight_map": {names[0]: shard, **{n: "model.safetensors" for n in names[1:]}}}
    return wm


def bd(*damages, base: str = "bundle", cmd: str = "generate", update_report: bool = False):
    """A copy of a fixture bundle with ``damages`` (callables of (ctx, bundle)) applied; the report's sizes
    and CRCs brought up to date after them when ``update_report``."""
    def setup(ctx: Ctx) -> Run:
        b = ctx.bundle(base=base)
        for dmg in damages:
            dmg(ctx, b)
        if update_report:
            refresh(b)
        return CMD[cmd](ctx, b)
    return setup


def at(name: str, damage):
    """A bundle damage: ``damage`` (see damage_file) applied to the bundle's file ``name``."""
    return lambda ctx, b: damage_file(ctx, b / name, damage)


def cli(*extra, cmd: str = "generate", model: str = "tiny"):
    """A command with misused flags on the tiny checkpoint ("tiny"), the bundled model ("data") or a bundle."""
    def setup(ctx: Ctx) -> Run:
        d = {"tiny": lambda: ctx.tiny(), "data": lambda: ctx.fx.data_model, "bundle": lambda: ctx.bundle()}[model]()
        if cmd == "generate":
            return Run(["generate", "--model", str(d), "--max-new-tokens", "2", *(
                () if "--prompt" in extra else ("--prompt", PROMPT)), *extra])
        if cmd == "perplexity":
            return Run(["perplexity", "--model", str(d), *(() if "--text" in extra else ("--text", str(ctx.text()))), *extra])
        if cmd == "quantize":
            return Run(["quantize", "--model", str(d), *extra])
        return Run([cmd, "--model", str(d), *extra])
    return setup


def argv(*args):
    return lambda ctx: Run(list(args))


def outside_link(folder: str, name: str) -> str:
    """The expected message for ``folder/name``, a symlink to the copy that ``Ctx.move_outside`` planted."""
    n = re.escape(name)
    return rf"{folder}/{n}: resolves to \S*/outside/{n}, outside \S*/{folder} \(a symlink leaving the folder; pass --allow-outside"


def rows(kind: str, table: list) -> list[Case]:
    """``(id, setup, expect[, message])`` tuples -> Cases."""
    return [Case(row[0], kind, *row[1:]) for row in table]


# ---- checkpoints --------------------------------------------------------------------------------------------
CFG_DEEP = json.dumps({"architectures": ["MixtralForCausalLM"]}).encode()[:-1] + b", " + deep_json()[1:]

CHECKPOINT = rows("checkpoint", [
    ("valid", ck(), VALID),
    ("valid-info", ck(cmd="info"), VALID),
    ("valid-perplexity", ck(cmd="perplexity"), VALID),
    # config.json as a file
    ("config-not-utf8", ck(b'{"architectures": ["Mixtral\xff\xfe"]}', "config.json"), BAD,
     CONFIG_JSON + r"not UTF-8 text \(byte 0xff at offset 27\)"),
    ("config-not-utf8-info", ck(b'{"architectures": ["Mixtral\xff\xfe"]}', "config.json", cmd="info"), BAD,
     CONFIG_JSON + r"not UTF-8 text \(byte 0xff at offset 27\)"),
    ("config-directory", ck("dir", "config.json"), BAD, CONFIG_JSON + r"is a directory, not a regular file"),
    ("config-fifo", ck("fifo", "config.json"), BAD, CONFIG_JSON + r"is a FIFO, not a regular file"),
    ("config-missing", ck("missing", "config.json"), BAD, CONFIG_JSON + r"no config\.json"),
    ("config-empty", ck(b"", "config.json"), BAD, CONFIG_JSON + r"not valid JSON \(Expecting value"),
    ("config-invalid-json", ck(b'{"hidden_size": ', "config.json"), BAD, CONFIG_JSON + r"not valid JSON \(Expecting value"),
    ("config-json-list", ck(b"[1, 2, 3]", "config.json"), BAD, CONFIG_JSON + r"expected a JSON object, found a list"),
    ("config-json-string", ck(b'"MixtralForCausalLM"', "config.json"), BAD, CONFIG_JSON + r"expected a JSON object, found a string"),
    ("config-json-null", ck(b"null", "config.json"), BAD, CONFIG_JSON + r"expected a JSON object, found null"),
    ("config-deep-nesting", ck(CFG_DEEP, "config.json"), BAD, CONFIG_JSON + r"JSON nested 100001 levels deep \(at most 32 expected\)"),
    ("config-symlink-outside", ck("outside", "config.json"), BAD, outside_link("model", "config.json")),
    # config.json values: wrong types
    ("config-hidden-size-string", cfg(hidden_size="sixty-four"), BAD,
     CONFIG_JSON + r"'hidden_size' must be an integer in \[1, 65536\], got 'sixty-four'"),
    ("config-hidden-size-list", cfg(hidden_size=[64]), BAD, CONFIG_JSON + r"'hidden_size' must be an integer in \[1, 65536\], got a list"),
    ("config-hidden-size-bool", cfg(hidden_size=True), BAD, CONFIG_JSON + r"'hidden_size' must be an integer in \[1, 65536\], got True"),
    ("config-heads-object", cfg(num_attention_heads={}), BAD,
     CONFIG_JSON + r"'num_attention_heads' must be an integer in \[1, 1024\], got an object"),
    ("config-vocab-fraction", cfg(vocab_size=8192.5), BAD, CONFIG_JSON + r"'vocab_size' must be an integer in \[1, 16777216\], got 8192\.5"),
    ("config-layers-numeric-string", cfg(num_hidden_layers="2"), EITHER),
    ("config-architectures-string", cfg(architectures="MixtralForCausalLM"), EITHER),
    ("config-rope-scaling-string", cfg(rope_scaling="linear"), BAD, CONFIG_JSON + r"'rope_scaling' must be an object, got 'linear'"),
    ("config-eos-string", cfg(eos_token_id="two"), BAD,
     CONFIG_JSON + r"'eos_token_id' must be a non-negative token id \(or a list of them\), got 'two'"),
    ("config-eos-negative", cfg(eos_token_id=-5), BAD,
     CONFIG_JSON + r"'eos_token_id' must be a non-negative token id \(or a list of them\), got -5"),
    ("config-eos-beyond-vocab", cfg(eos_token_id=50279), VALID),  # a warning: generation never stops on it
    ("config-bos-beyond-vocab", cfg(bos_token_id=999_999), BAD, CONFIG_JSON + r"'bos_token_id' must be a token id in \[0, 8192\), got 999999"),
    ("config-sliding-window-string", cfg(sliding_window="wide"), BAD,
     CONFIG_JSON + r"'sliding_window' must be an integer in \[0, 16777216\], got 'wide'"),
    # config.json values: out of range
    ("config-hidden-size-infinity", cfg(hidden_size=float("inf")), BAD, CONFIG_JSON + r"not valid JSON \(Infinity is not a JSON number\)"),
    ("config-rope-theta-infinity", cfg(rope_theta=float("inf")), BAD, CONFIG_JSON + r"not valid JSON \(Infinity is not a JSON number\)"),
    ("config-rms-eps-nan", cfg(rms_norm_eps=float("nan")), BAD, CONFIG_JSON + r"not valid JSON \(NaN is not a JSON number\)"),
    ("config-zero-heads", cfg(num_attention_heads=0), BAD, CONFIG_JSON + r"'num_attention_heads' must be an integer in \[1, 1024\], got 0"),
    ("config-zero-kv-heads", cfg(num_key_value_heads=0), BAD, CONFIG_JSON + r"'num_key_value_heads' must be an integer in \[1, 1024\], got 0"),
    ("config-kv-heads-not-dividing", cfg(num_key_value_heads=3), BAD,
     CONFIG_JSON + r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ("config-heads-not-dividing-hidden", cfg(num_attention_heads=5, num_key_value_heads=1), BAD,
     CONFIG_JSON + r"hidden_size \(64\) must be a multiple of num_attention_heads \(5\)"),
    ("config-yarn-without-factor", cfg(rope_scaling={"rope_type": "yarn"}), BAD, CONFIG_JSON + r"missing key 'rope_scaling\.factor'"),
    ("config-linear-factor-zero", cfg(rope_scaling={"rope_type": "linear", "factor": 0}), BAD,
     CONFIG_JSON + r"'rope_scaling\.factor' must be a finite number in \(0, 1e\+06\], got 0"),
    ("config-rope-type-unknown", cfg(rope_scaling={"rope_type": "spiral"}), BAD,
     CONFIG_JSON + r"rope type 'spiral' is not supported \(default, linear, llama3, yarn\)"),
    ("config-layers-0", cfg(num_hidden_layers=0), BAD, CONFIG_JSON + r"'num_hidden_layers' must be an integer in \[1, 1024\], got 0"),
    ("config-layers-minus-1", cfg(num_hidden_layers=-1), BAD, CONFIG_JSON + r"'num_hidden_layers' must be an integer in \[1, 1024\], got -1"),
    ("config-layers-1e9", cfg(num_hidden_layers=1_000_000_000), BAD,
     CONFIG_JSON + r"'num_hidden_layers' must be an integer in \[1, 1024\], got 1000000000"),
    ("config-layers-1e9-info", cfg(cmd="info", num_hidden_layers=1_000_000_000), BAD,
     CONFIG_JSON + r"'num_hidden_layers' must be an integer in \[1, 1024\], got 1000000000"),
    ("config-layers-beyond-checkpoint", cfg(num_hidden_layers=3), BAD,
     r"model: config\.json declares 3 layers \(num_hidden_layers\), the checkpoint holds 2 \(model\.layers\.0 \.\. 1\)"),
    ("config-top-k-0", cfg(num_experts_per_tok=0), BAD, CONFIG_JSON + r"'num_experts_per_tok' must be an integer in \[1, 4096\], got 0"),
    ("config-top-k-minus-1", cfg(num_experts_per_tok=-1), BAD, CONFIG_JSON + r"'num_experts_per_tok' must be an integer in \[1, 4096\], got -1"),
    ("config-top-k-9-of-8", cfg(base="tiny8", num_experts_per_tok=9), BAD,
     CONFIG_JSON + r"num_experts_per_tok \(9\) must be at most num_local_experts \(8\)"),
    ("config-experts-0", cfg(num_local_experts=0), BAD, CONFIG_JSON + r"'num_local_experts' must be an integer in \[1, 4096\], got 0"),
    ("config-rms-eps-minus-1", cfg(rms_norm_eps=-1), BAD, CONFIG_JSON + r"'rms_norm_eps' must be a finite number in \(0, 1\], got -1"),
    ("config-rope-theta-0", cfg(rope_theta=0), BAD, CONFIG_JSON + r"'rope_theta' must be a finite number in \(0, 1e\+12\], got 0"),
    ("config-rope-theta-minus-1", cfg(rope_theta=-1), BAD, CONFIG_JSON + r"'rope_theta' must be a finite number in \(0, 1e\+12\], got -1"),
    ("config-max-positions-0", cfg(max_position_embeddings=0), BAD,
     CONFIG_JSON + r"'max_position_embeddings' must be an integer in \[1, 16777216\], got 0"),
    ("config-max-positions-minus-1", cfg(max_position_embeddings=-1), BAD,
     CONFIG_JSON + r"'max_position_embeddings' must be an integer in \[1, 16777216\], got -1"),
    ("config-vocab-0", cfg(vocab_size=0), BAD, CONFIG_JSON + r"'vocab_size' must be an integer in \[1, 16777216\], got 0"),
    ("config-sliding-window-minus-1", cfg(sliding_window=-1), BAD, CONFIG_JSON + r"'sliding_window' must be an integer in \[0, 16777216\], got -1"),
    ("config-head-dim-huge", cfg(cmd="info", head_dim=2**40), BAD, CONFIG_JSON + r"'head_dim' must be an integer in \[2, 1024\], got 1099511627776"),
    ("config-architecture-unsupported", cfg(architectures=["LlamaForCausalLM"]), BAD,
     CONFIG_JSON + r"architecture \['LlamaForCausalLM'\] is not supported; supported: (\w+, )*MixtralForCausalLM"),
    ("config-missing-hidden-size", cfg(hidden_size=DROP), BAD, CONFIG_JSON + r"missing key 'hidden_size'"),
    # generation_config.json, tokenizer_config.json, tokenizer.json
    ("genconfig-list", ck(b"[]", "generation_config.json"), BAD, r"model/generation_config\.json: expected a JSON object, found a list"),
    ("genconfig-invalid-json", ck(b"{", "generation_config.json"), BAD, r"model/generation_config\.json: not valid JSON \(Expecting property name"),
    ("genconfig-not-utf8", ck(b'{"eos_token_id": "\xff"}', "generation_config.json"), BAD,
     r"model/generation_config\.json: not UTF-8 text \(byte 0xff at offset 18\)"),
    ("genconfig-eos-object", ck(b'{"eos_token_id": {"a": 1}}', "generation_config.json"), BAD,
     r"model/generation_config\.json: 'eos_token_id' must be a non-negative token id \(or a list of them\), got an object"),
    ("genconfig-eos-string", ck(b'{"eos_token_id": "2"}', "generation_config.json"), BAD,
     r"model/generation_config\.json: 'eos_token_id' must be a non-negative token id \(or a list of them\), got '2'"),
    ("genconfig-bos-list", ck(b'{"bos_token_id": [1]}', "generation_config.json"), BAD,
     r"model/generation_config\.json: 'bos_token_id' must be a token id in \[0, 8192\), got a list"),
    ("genconfig-directory", ck("dir", "generation_config.json"), BAD, r"model/generation_config\.json: is a directory, not a regular file"),
    ("genconfig-fifo", ck("fifo", "generation_config.json"), BAD, r"model/generation_config\.json: is a FIFO, not a regular file"),
    ("tokconfig-list", ck(b"[]", "tokenizer_config.json"), BAD, r"model/tokenizer_config\.json: expected a JSON object, found a list"),
    ("tokconfig-invalid-json", ck(b"{", "tokenizer_config.json"), BAD, r"model/tokenizer_config\.json: not valid JSON \(Expecting property name"),
    ("tokconfig-not-utf8", ck(b'{"bos_token": "\xff"}', "tokenizer_config.json"), BAD,
     r"model/tokenizer_config\.json: not UTF-8 text \(byte 0xff at offset 15\)"),
    ("tokconfig-directory", ck("dir", "tokenizer_config.json"), BAD, r"model/tokenizer_config\.json: is a directory, not a regular file"),
    ("tokconfig-add-bos-string", ck(b'{"add_bos_token": "no"}', "tokenizer_config.json"), BAD,
     r"model/tokenizer_config\.json: 'add_bos_token' must be true or false, got 'no'"),
    ("tokenizer-missing", ck("missing", "tokenizer.json"), BAD, r"model: no tokenizer\.json"),
    ("tokenizer-invalid-json", ck(b"{", "tokenizer.json"), BAD, r"model/tokenizer\.json: cannot load tokenizer \(EOF while parsing"),
    ("tokenizer-truncated", ck(truncate(1000), "tokenizer.json"), BAD, r"model/tokenizer\.json: cannot load tokenizer \(EOF while parsing"),
    ("tokenizer-directory", ck("dir", "tokenizer.json"), BAD, r"model/tokenizer\.json: is a directory, not a regular file"),
    ("tokenizer-fifo", ck("fifo", "tokenizer.json"), BAD, r"model/tokenizer\.json: is a FIFO, not a regular file"),
    ("tokenizer-symlink-outside", ck("outside", "tokenizer.json"), BAD, outside_link("model", "tokenizer.json")),
    ("tokenizer-vocab-beyond-model", ck(base="tiny_v64"), BAD, r"the prompt encodes to token id 820, beyond the model's vocab_size 64 \(tokenizer\.json has 8192 tokens"),
    # model.safetensors as a file
    ("st-empty", ck(b""), BAD, ST + r"truncated \(no safetensors header\)"),
    ("st-4-bytes", ck(truncate(4)), BAD, ST + r"truncated \(no safetensors header\)"),
    ("st-truncated-in-header", ck(truncate(200)), BAD, ST + r"header length \d+ exceeds the file \(200 bytes\)"),
    ("st-truncated-in-data", ck(truncate(lambda n: n // 2)), BAD, ST + r"tensor '[\w.]+' offsets \[\d+, \d+\) lie outside the data \(\d+ bytes\)"),
    ("st-last-byte-missing", ck(truncate(lambda n: n - 1)), BAD, ST + r"tensor '[\w.]+' offsets \[\d+, \d+\) lie outside the data \(\d+ bytes\)"),
    ("st-directory", ck("dir"), BAD, ST + r"is a directory, not a regular safetensors file"),
    ("st-fifo-beside", ck("fifo", "extra.safetensors"), BAD, r"model/extra\.safetensors: is a FIFO, not a regular safetensors file"),
    ("st-dev-zero", ck("dev-zero"), BAD, ST + r"resolves to /dev/zero, outside \S*/model \(a symlink leaving the folder"),
    ("st-symlink-outside", ck("outside"), BAD, outside_link("model", "model.safetensors")),
    # the safetensors header
    ("st-header-length-2^64-1", ck(header_edit(header_length(lambda n: 2**64 - 1))), BAD,
     ST + r"header length 18446744073709551615 exceeds the file \(\d+ bytes\)"),
    ("st-header-length-short", ck(header_edit(header_length(lambda n: n - 12))), BAD, ST + r"safetensors header: not valid JSON"),
    ("st-header-length-into-data", ck(header_edit(header_length(lambda n: n + 64))), BAD, ST + r"safetensors header: not UTF-8 text"),
    ("st-header-length-0", ck(header_edit(header_length(lambda n: 0))), BAD, ST + r"safetensors header: not valid JSON"),
    ("st-header-list", ck(header_edit(lambda h, d: (None, d, b"[]"))), BAD, ST + r"safetensors header: expected a JSON object, found a list"),
    ("st-header-not-utf8", ck(header_edit(lambda h, d: (None, d, b'{"\xff": 1}'))), BAD,
     ST + r"safetensors header: not UTF-8 text \(byte 0xff at offset 2\)"),
    ("st-header-deep-nesting", ck(header_edit(deep_header)), BAD, ST + r"safetensors header: JSON nested 100001 levels deep \(at most 4 expected\)"),
    ("st-header-deep-nesting-info", ck(header_edit(deep_header), cmd="info"), BAD,
     ST + r"safetensors header: JSON nested 100001 levels deep \(at most 4 expected\)"),
    ("st-header-duplicate-key", ck(header_edit(duplicate_key)), BAD,
     ST + r"safetensors header: not valid JSON \(key 'lm_head\.weight' appears twice in one object\)"),
    ("st-metadata-list", ck(header_edit(lambda h, d: h.update({"__metadata__": ["x"]}))), EITHER),
    ("st-shape-2^70", ck(header_edit(shape_of("model.norm.weight", [2**70]))), BAD,
     ST + r"tensor 'model\.norm\.weight' has 256 bytes, but F32\[1180591620717411303424\] needs 4722366482869645213696"),
    ("st-shape-2^70-info", ck(header_edit(shape_of("model.norm.weight", [2**70])), cmd="info"), BAD,
     ST + r"tensor 'model\.norm\.weight' has 256 bytes, but F32\[1180591620717411303424\] needs 4722366482869645213696"),
    ("st-shape-float", ck(header_edit(shape_of("lm_head.weight", [8192.5, 64]))), BAD,
     ST + r"tensor 'lm_head\.weight' has a malformed header entry \(shape entries must be non-negative integers\)"),
    ("st-shape-negative", ck(header_edit(shape_of("lm_head.weight", [-8192, -64]))), BAD,
     ST + r"tensor 'lm_head\.weight' has a malformed header entry \(shape entries must be non-negative integers\)"),
    ("st-shape-string", ck(header_edit(shape_of("lm_head.weight", "8192x64"))), BAD,
     ST + r"tensor 'lm_head\.weight' has a malformed header entry \(shape must be a list of at most 8 dimensions\)"),
    ("st-shape-overflow-extra", ck(header_edit(overflow_extra)), BAD,
     ST + r"tensor 'overflow' has 0 bytes, but U8\[4294967296, 4294967296\] needs 18446744073709551616"),
    ("st-shape-overflow-used", ck(header_edit(overflow_used("model.norm.weight"))), BAD,
     ST + r"tensor 'model\.norm\.weight' has 0 bytes, but F32\[4611686018427387904, 4\] needs 73786976294838206464"),
    ("st-overlap", ck(header_edit(overlap)), BAD, ST + r"tensors '[\w.]+' and '[\w.]+' overlap in the data section"),
    ("st-overlap-hidden-by-empty", ck(header_edit(overlap_hidden_by_empty)), BAD, ST + r"tensors '[\w.]+' and '[\w.]+' overlap in the data section"),
    ("st-offsets-reversed", ck(header_edit(header_field("lm_head.weight", "data_offsets", [2097152, 0]))), BAD,
     ST + r"tensor 'lm_head\.weight' offsets \[2097152, 0\) lie outside the data"),
    ("st-offsets-beyond-data", ck(header_edit(header_field("lm_head.weight", "data_offsets", [0, 2**40]))), BAD,
     ST + r"tensor 'lm_head\.weight' offsets \[0, 1099511627776\) lie outside the data"),
    ("st-offsets-negative", ck(header_edit(header_field("lm_head.weight", "data_offsets", [-8, 2097144]))), BAD,
     ST + r"tensor 'lm_head\.weight' offsets \[-8, 2097144\) lie outside the data"),
    ("st-offsets-strings", ck(header_edit(header_field("lm_head.weight", "data_offsets", ["0", "2097152"]))), BAD,
     ST + r"tensor 'lm_head\.weight' has a malformed header entry \(data_offsets must be two integers\)"),
    ("st-dtype-unknown", ck(header_edit(header_field("lm_head.weight", "dtype", "F128"))), BAD,
     ST + r"tensor 'lm_head\.weight' has a malformed header entry \(unknown dtype 'F128'\)"),
    ("st-dtype-missing", ck(header_edit(header_field("lm_head.weight", "dtype", DROP))), BAD, ST + r"tensor 'lm_head\.weight' has a malformed header entry \(no dtype\)"),
    ("st-byte-length-mismatch", ck(header_edit(header_field("lm_head.weight", "shape", [8192, 32]))), BAD,
     ST + r"tensor 'lm_head\.weight' has 2097152 bytes, but F32\[8192, 32\] needs 1048576"),
    # the tensors
    ("st-nan-weight", ck(tensors_edit(set_values("lm_head.weight", np.nan))), BAD,
     r"model: tensor 'lm_head\.weight' holds NaN or inf \(first at \(0, 0\)\)"),
    ("st-inf-expert-int4", inf_expert_int4, BAD, r"model: tensor 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight' holds NaN or inf"),
    ("st-missing-lm-head", ck(tensors_edit(drop("lm_head.weight"))), BAD, r"model: checkpoint has no tensor 'lm_head\.weight' \(and tie_word_embeddings is false\)"),
    ("st-missing-expert", ck(tensors_edit(drop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))), BAD,
     r"model: checkpoint has no tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight'"),
    ("st-missing-router", ck(tensors_edit(drop("model.layers.0.block_sparse_moe.gate.weight"))), BAD,
     r"model: no router for layer 0 \(looked for model\.layers\.0\.block_sparse_moe\.gate\.weight"),
    ("st-wrong-shape-embed", ck(tensors_edit(entry("model.embed_tokens.weight", shape=[4096, 128]))), BAD,
     r"tensor 'model\.embed_tokens\.weight' has shape \[4096, 128\], the config implies \[8192, 64\]"),
    ("st-wrong-shape-expert", ck(tensors_edit(entry("model.layers.0.block_sparse_moe.experts.0.w2.weight", shape=[32, 128]))), BAD, ST + r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w2\.weight' has shape \[32, 128\], the config implies \[64, 64\]"),
    ("st-int-dtype-weight", ck(tensors_edit(entry("lm_head.weight", dtype="I32"))), EITHER),
    ("st-extra-tensor", ck(tensors_edit(add_tensor("model.extra.weight", "F32", [4], b"\0" * 16))), EITHER),
    ("st-no-safetensors", ck("missing"), BAD, r"model: no \*\.safetensors files and no model\.safetensors\.index\.json"),
    # model.safetensors.index.json
    ("index-absolute-path", ck_index(every_tensor_in(shard_outside_absolute)), BAD,
     INDEX + r"file name '/\S+/outside/model\.safetensors' points outside the folder"),
    ("index-dotdot-path", ck_index(every_tensor_in(shard_outside_relative)), BAD,
     INDEX + r"file name '\.\./outside/model\.safetensors' points outside the folder"),
    ("index-dotdot-path-info", ck_index(every_tensor_in(shard_outside_relative), cmd="info"), BAD,
     INDEX + r"file name '\.\./outside/model\.safetensors' points outside the folder"),
    ("index-etc-passwd", ck_index(first_tensor_in("/etc/passwd")), BAD, INDEX + r"file name '/etc/passwd' points outside the folder"),
    ("index-dotdot-etc-passwd", ck_index(first_tensor_in("../../../../../../../../../etc/passwd")), BAD,
     INDEX + r"file name '(\.\./)+etc/passwd' points outside the folder"),
    ("index-symlinked-shard-outside", ck_index(every_tensor_in(shard_symlinked_outside)), BAD, outside_link("model", "model.safetensors")),
    ("index-names-fifo", ck_index(first_tensor_in("fifo.safetensors", lambda ctx, d: os.mkfifo(d / "fifo.safetensors"))), BAD,
     r"model/fifo\.safetensors: is a FIFO, not a regular shard"),
    ("index-names-directory", ck_index(first_tensor_in("sub", lambda ctx, d: (d / "sub").mkdir())), BAD,
     r"model/sub: is a directory, not a regular shard"),
    ("index-names-missing-shard", ck_index(first_tensor_in("model-00002-of-00002.safetensors")), BAD,
     INDEX + r"shard 'model-00002-of-00002\.safetensors' \(holding 'lm_head\.weight'\) is missing"),
    ("index-fifo", ck_index(lambda ctx, d, names: os.mkfifo(d / "model.safetensors.index.json")), BAD, INDEX + r"is a FIFO, not a regular file"),
    ("index-directory", ck_index(lambda ctx, d, names: (d / "model.safetensors.index.json").mkdir()), BAD,
     INDEX + r"is a directory, not a regular file"),
    ("index-list", ck_index(lambda ctx, d, names: []), BAD, INDEX + r"expected a JSON object, found a list"),
    ("index-weight-map-list", ck_index(lambda ctx, d, names: {"weight_map": names}), BAD, INDEX + r"'weight_map' must be an object, got a list"),
    ("index-weight-map-int-values", ck_index(lambda ctx, d, names: {"weight_map": {n: 5 for n in names}}), BAD,
     INDEX + r"'weight_map' must map tensor names to shard file names"),
    ("index-no-weight-map", ck_index(lambda ctx, d, names: {"metadata": {}}), BAD, INDEX + r"'weight_map' must map tensor names to shard file names"),
    ("index-invalid-json", ck_index(lambda ctx, d, names: b'{"weight_map": '), BAD, INDEX + r"not valid JSON"),
    ("index-not-utf8", ck_index(lambda ctx, d, names: b'{"weight_map": {"\xff": 1}}'), BAD, INDEX + r"not UTF-8 text \(byte 0xff at offset 17\)"),
    ("index-deep-nesting", ck_index(lambda ctx, d, names: deep_json()), BAD, INDEX + r"JSON nested 100001 levels deep \(at most 32 expected\)"),
    ("index-incomplete", ck_index(lambda ctx, d, names: {"weight_map": {n: "model.safetensors" for n in names if n != "lm_head.weight"}}), BAD, INDEX + r"lists no tensor 'lm_head\.weight' \(and tie_word_embeddings is false\)"),
])


# ---- UQFF bundles ---------------------------------------------------------------------------------------------
R = "uqff_report.json"
S0 = "model-0.uqff"
RES = "residual.safetensors"


def rpt(fn):
    """A damage of the report (its sizes and CRCs left as they are unless the row updates them)."""
    return at(R, report_edit(fn))


def shard(fn, name: str = S0):
    return at(name, tensors_edit(fn))


def shard_header(fn, name: str = S0):
    return at(name, header_edit(fn))


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


BUNDLE = rows("bundle", [
    ("valid", bd(), VALID),
    ("valid-inspect", bd(cmd="inspect"), VALID),
    ("valid-sharded", bd(base="sharded"), VALID),
    # the report
    ("report-missing", bd(at(R, "missing")), BAD,
     r"bundle: not a complete UQFF bundle \(no uqff_report\.json; an interrupted save or not a bundle\)"),
    ("report-invalid-json", bd(at(R, b'{"files": ')), BAD, REPORT + r"not valid JSON"),
    ("report-not-utf8", bd(at(R, b'{"files": "\xff"}')), BAD, REPORT + r"not UTF-8 text \(byte 0xff at offset 11\)"),
    ("report-list", bd(at(R, b"[]")), BAD, REPORT + r"expected a JSON object, found a list"),
    ("report-list-inspect", bd(at(R, b"[]"), cmd="inspect"), BAD, REPORT + r"expected a JSON object, found a list"),
    ("report-directory", bd(at(R, "dir")), BAD, REPORT + r"is a directory, not a regular file"),
    ("report-fifo", bd(at(R, "fifo")), BAD, REPORT + r"is a FIFO, not a regular file"),
    ("report-deep-nesting", bd(at(R, deep_json())), BAD, REPORT + r"JSON nested 100001 levels deep \(at most 32 expected\)"),
    ("report-symlink-outside", bd(at(R, "outside")), BAD, outside_link("bundle", "uqff_report.json")),
    ("report-no-files", bd(rpt(lambda r: r.pop("files"))), BAD, REPORT + r"malformed report \('files' is missing\)"),
    ("report-no-shards", bd(rpt(lambda r: r.pop("shards"))), BAD, REPORT + r"malformed report \('shards' is missing\)"),
    ("report-shards-object", bd(rpt(lambda r: r.update(shards={"file": S0}))), BAD, REPORT + r"malformed report \('shards' must be a list, found an object\)"),
    ("report-shard-without-file", bd(rpt(lambda r: r["shards"][0].pop("file"))), BAD, REPORT + r"malformed report \('shards\[0\]\.file' is missing\)"),
    ("report-shard-listed-twice", bd(rpt(lambda r: r["shards"].append(dict(r["shards"][0])))), BAD,
     REPORT + r"the shard list names a shard twice: \['model-0\.uqff', 'model-0\.uqff'\]"),
    ("report-bytes-string", bd(rpt(lambda r: r["files"][S0].update(bytes="many"))), BAD, REPORT + r"malformed report \('files\.model-0\.uqff\.bytes' must be a non-negative integer, found 'many'\)"),
    ("report-bytes-infinity", bd(rpt(lambda r: r["files"][S0].update(bytes=float("inf")))), BAD,
     REPORT + r"not valid JSON \(Infinity is not a JSON number\)"),
    ("report-crc-string", bd(rpt(lambda r: r["files"][S0].update(crc32="abc"))), BAD, REPORT + r"malformed report \('files\.model-0\.uqff\.crc32' must be a non-negative integer, found 'abc'\)"),
    ("report-file-entry-list", bd(rpt(lambda r: r["files"].update({S0: [1, 2]}))), BAD, REPORT + r"malformed report \('files\.model-0\.uqff' must be an object, found a list\)"),
    ("report-lacks-residual", bd(rpt(lambda r: r["files"].pop(RES))), BAD, REPORT + r"does not list residual\.safetensors"),
    ("report-lacks-tokenizer", bd(rpt(lambda r: r["files"].pop("tokenizer.json"))), BAD, REPORT + r"does not list tokenizer\.json"),
    ("report-wrong-size", bd(rpt(lambda r: r["files"][S0].update(bytes=r["files"][S0]["bytes"] + 1))), BAD,
     SHARD0 + r"\d+ bytes, the report says \d+ \(truncated\)"),
    ("report-wrong-crc", bd(rpt(lambda r: r["files"][S0].update(crc32=(r["files"][S0]["crc32"] + 1) % 2**32))), BAD,
     SHARD0 + r"CRC-32 mismatch \(the file changed after it was written\)"),
    ("report-files-names-outside", bd(rpt(lambda r: r["files"].update({"../outside.txt": {"bytes": 1, "crc32": 0}}))), BAD,
     REPORT + r"file name '\.\./outside\.txt' points outside the folder"),
    ("report-shard-dotdot-path", bd(shard_outside_listed), BAD, REPORT + r"file name '\.\./outside/model-0\.uqff' points outside the folder"),
    ("report-shard-absolute-path", bd(shard_absolute_listed), BAD, REPORT + r"file name '/\S+/outside/model-0\.uqff' points outside the folder"),
    ("report-layers-not-list", bd(rpt(lambda r: r.update(layers="all"))), BAD, REPORT + r"malformed report \('layers' must be a list, found a string\)"),
    ("report-layers-missing", bd(rpt(lambda r: r.pop("layers"))), BAD, REPORT + r"malformed report \('layers' is missing\)"),
    ("report-layer-format-lie", bd(rpt(lambda r: r["layers"][0].update(format="int2-g64", bytes=1))), BAD,
     SHARD0 + rf"layer '{L}' is int4-g64\[4, 64, 64\] in \d+ bytes, the report's layer table says int2-g64\[4, 64, 64\] in 1 bytes"),
    ("report-layer-shape-lie", bd(rpt(lambda r: r["layers"][0].update(shape=[4, 32, 64]))), BAD,
     SHARD0 + rf"layer '{L}' is int4-g64\[4, 64, 64\] in \d+ bytes, the report's layer table says int4-g64\[4, 32, 64\]"),
    ("report-layer-extra", bd(rpt(lambda r: r["layers"].append({**r["layers"][0], "key": "model.layers.5.x"}))), BAD,
     r"layer 'model\.layers\.5\.x' \(listed in \S*bundle/uqff_report\.json\) is missing from every shard"),
    ("report-policy-number", bd(rpt(lambda r: r.update(policy=5))), EITHER),
    ("report-version-9", bd(rpt(lambda r: r.update(version="9.0.0"))), EITHER),
    ("report-weights-malformed-inspect", bd(rpt(lambda r: r.update(weights=[{"shape": "abc"}])), cmd="inspect"), EITHER),
    # shards as files
    ("shard-truncated", bd(at(S0, truncate(lambda n: n - 100))), BAD, SHARD0 + r"\d+ bytes, the report says \d+ \(truncated\)"),
    ("shard-truncated-report-updated", bd(at(S0, truncate(lambda n: n - 100)), update_report=True), BAD,
     SHARD0 + r"tensor '[\w.]+' offsets \[\d+, \d+\) lie outside the data \(\d+ bytes\)"),
    ("shard-empty-report-updated", bd(at(S0, b""), update_report=True), BAD, SHARD0 + r"truncated \(no safetensors header\)"),
    ("shard-byte-changed", bd(at(S0, flip_byte())), BAD, SHARD0 + r"CRC-32 mismatch \(the file changed after it was written\)"),
    ("shard-missing", bd(at(S0, "missing")), BAD, SHARD0 + r"missing \(listed in uqff_report\.json\)"),
    ("shard-directory", bd(at(S0, "dir")), BAD, SHARD0 + r"is a directory, not a regular file"),
    ("shard-fifo", bd(at(S0, "fifo")), BAD, SHARD0 + r"is a FIFO, not a regular file"),
    ("shard-dev-zero", bd(at(S0, "dev-zero")), BAD, SHARD0 + r"resolves to /dev/zero, outside \S*/bundle \(a symlink leaving the folder"),
    ("shard-symlink-outside", bd(at(S0, "outside")), BAD, outside_link("bundle", "model-0.uqff")),
    ("shard-symlink-outside-inspect", bd(at(S0, "outside"), cmd="inspect"), BAD, outside_link("bundle", "model-0.uqff")),
    ("shard-extra-unlisted", bd(extra_shard(listed=False)), BAD, r"bundle: shard\(s\) model-1\.uqff are not listed in uqff_report\.json"),
    ("shard-extra-listed", bd(extra_shard(listed=True), update_report=True), BAD,
     rf"bundle: tensor '{L}\.weight' is in both model-0\.uqff and model-1\.uqff"),
    # shard contents (sizes and CRCs updated, so only the contents tell)
    ("shard-version-missing", bd(shard(drop("uqff.version.patch")), update_report=True), BAD,
     SHARD0 + r"no uqff\.version\.patch tensor \(not a UQFF shard, or written before versioning\)"),
    ("shard-version-major-2", bd(shard(entry("uqff.version.major", data=u32(2))), update_report=True), BAD,
     SHARD0 + r"UQFF version 2\.\d+\.\d+ is not readable by this toolkit \(reads 1\.0 \.\. "),
    ("shard-version-minor-9", bd(shard(entry("uqff.version.minor", data=u32(9))), update_report=True), BAD,
     SHARD0 + r"UQFF version 1\.9\.\d+ is not readable by this toolkit \(reads 1\.0 \.\. "),
    ("shard-version-u8", bd(shard(entry("uqff.version.major", dtype="U8", data=b"\x01")), update_report=True), BAD,
     SHARD0 + r"tensor 'uqff\.version\.major' is uint8\[\], expected a U32 scalar"),
    ("shard-version-shape-1", bd(shard(entry("uqff.version.major", shape=[1])), update_report=True), BAD,
     SHARD0 + r"tensor 'uqff\.version\.major' is uint32\[1\], expected a U32 scalar"),
    ("shard-tag-unknown-7", bd(shard(entry(LAYER + ".weight.format", data=b"\x07")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.format': unknown format tag 7; known: 0=Gguf, 1=Unquant, 100=MoqeAffine"),
    ("shard-tag-mistralrs-fp8", bd(shard(entry(LAYER + ".weight.format", data=b"\x03")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.format': unknown format tag 3 \(mistral\.rs family Fp8, not read by this toolkit\)"),
    ("shard-tag-255", bd(shard(entry(LAYER + ".weight.format", data=b"\xff")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.format': unknown format tag 255; known: 0=Gguf"),
    ("shard-tag-other-family", bd(shard(entry(LAYER + ".weight.format", data=b"\x65")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.biases' belongs to no layer \(no matching \.weight\.format\)"),
    ("shard-tag-u32", bd(shard(entry(LAYER + ".weight.format", dtype="U32", data=u32(100))), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.format' is uint32\[\], expected a U8 scalar"),
    ("shard-tag-missing", bd(shard(drop(LAYER + ".weight.format")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight' belongs to no layer \(no matching \.weight\.format\)"),
    ("shard-bits-5", bd(shard(entry(LAYER + ".weight.bits", data=b"\x05")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.bits': 5 bits is not one of \(2, 3, 4\)"),
    ("shard-bits-2-on-int4-data", bd(shard(entry(LAYER + ".weight.bits", data=b"\x02")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight': does not match format 'int2-g64'"),
    ("shard-group-size-0", bd(shard(entry(LAYER + ".weight.group_size", data=b"\x00")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.group_size': format 'int4' does not take group size 0; allowed: 32, 64, 128"),
    ("shard-scales-u16", bd(shard(entry(LAYER + ".weight.scales", dtype="U16")), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.scales' is uint16, expected float16"),
    # message to improve: blames 'scales' for the weight's permuted shape
    ("shard-weight-shape-permuted", bd(shard(entry(LAYER + ".weight", shape=[4, 8, 64])), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight': does not match format 'int4-g64'"),
    ("shard-scales-nan", bd(shard(set_values(LAYER + ".weight.scales", np.nan)), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight': .*scales hold 4 NaN or inf value\(s\)"),
    ("shard-header-deep-nesting", bd(shard_header(deep_header), update_report=True), BAD,
     SHARD0 + r"safetensors header: JSON nested 100001 levels deep \(at most 4 expected\)"),
    ("shard-header-deep-nesting-inspect", bd(shard_header(deep_header), update_report=True, cmd="inspect"), BAD,
     SHARD0 + r"safetensors header: JSON nested 100001 levels deep \(at most 4 expected\)"),
    ("shard-header-shape-2^70", bd(shard_header(shape_of(LAYER + ".weight.scales", [2**70])), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.scales' has 512 bytes, but F16\[1180591620717411303424\] needs 2361183241434822606848"),
    ("shard-header-shape-float", bd(shard_header(shape_of(LAYER + ".weight.scales", [4, 64.5, 1])), update_report=True), BAD,
     SHARD0 + rf"tensor '{L}\.weight\.scales' has a malformed header entry \(shape entries must be non-negative integers\)"),
    ("shard-header-overlap", bd(shard_header(overlap), update_report=True), BAD,
     SHARD0 + rf"tensors '{L}\.weight' and '{L}\.weight\.biases' overlap in the data section"),
    ("shard-header-overlap-hidden-by-empty", bd(shard_header(overlap_hidden_by_empty), update_report=True), BAD,
     SHARD0 + rf"tensors '{L}\.weight' and '{L}\.weight\.biases' overlap in the data section"),
    ("shard-header-length-lie", bd(shard_header(header_length(lambda n: n + 64)), update_report=True), BAD,
     SHARD0 + r"safetensors header: not UTF-8 text"),
    # shards against the report's layer table
    ("shard-layer-moved", bd(move_layer, base="sharded", update_report=True), BAD, rf"bundle/model-1\.uqff: holds layer '{L}', which the report's layer table places in model-0\.uqff"),
    ("shard-layer-copied", bd(copy_layer, base="sharded", update_report=True), BAD,
     rf"bundle: tensor '{L}\.weight' is in both model-0\.uqff and model-1\.uqff"),
    ("shard-layer-int2-transplant", bd(transplant_int2, update_report=True), BAD,
     SHARD0 + rf"layer '{L}' is int2-g64\[4, 64, 64\] in \d+ bytes, the report's layer table says int4-g64\[4, 64, 64\]"),
    ("shard-layer-dropped", bd(shard(drop_layer), update_report=True), BAD,
     SHARD0 + rf"layer '{L}' \(listed in \S*bundle/uqff_report\.json\) is missing from every shard"),
    ("shard-layer-renamed", bd(rename_layer, update_report=True), BAD,
     SHARD0 + rf"layer '{L}' \(listed in \S*bundle/uqff_report\.json\) is missing from every shard"),
    ("shard-layers-swapped", bd(shard(swap_layers), update_report=True), EITHER),
    # residual.safetensors
    ("residual-missing", bd(at(RES, "missing")), BAD, r"bundle/residual\.safetensors: missing \(listed in uqff_report\.json\)"),
    ("residual-truncated", bd(at(RES, truncate(lambda n: n - 100))), BAD,
     r"bundle/residual\.safetensors: \d+ bytes, the report says \d+ \(truncated\)"),
    ("residual-symlink-outside", bd(at(RES, "outside")), BAD, outside_link("bundle", "residual.safetensors")),
    ("residual-missing-tensor", bd(at(RES, tensors_edit(drop("lm_head.weight"))), update_report=True), BAD,
     r"bundle/residual\.safetensors: holds no tensor 'lm_head\.weight' \(and tie_word_embeddings is false\)"),
    ("residual-nan", bd(at(RES, tensors_edit(set_values("lm_head.weight", np.nan))), update_report=True), BAD,
     r"bundle/residual\.safetensors: tensor 'lm_head\.weight' holds NaN or inf \(first at \(0, 0\)\)"),
    ("residual-int-dtype", bd(at(RES, tensors_edit(entry("lm_head.weight", dtype="I32"))), update_report=True), BAD,
     r"bundle/residual\.safetensors: tensor 'lm_head\.weight' is int32, expected a float type"),
    ("residual-extra-tensor", bd(at(RES, tensors_edit(add_tensor("model.extra.weight", "F32", [4], b"\0" * 16))), update_report=True), BAD,
     r"bundle: 1 stored tensor\(s\) are not used by config\.json \(e\.g\. 'model\.extra\.weight'\)"),
    ("residual-shape-2^70", bd(at(RES, header_edit(shape_of("model.norm.weight", [2**70]))), update_report=True), BAD,
     r"bundle/residual\.safetensors: tensor 'model\.norm\.weight' has 256 bytes, but F32\[1180591620717411303424\] needs 4722366482869645213696"),
    # the JSON assets and the tokenizer
    ("tokenizer-symlink-outside", bd(at("tokenizer.json", "outside")), BAD, outside_link("bundle", "tokenizer.json")),
    ("tokenizer-missing", bd(at("tokenizer.json", "missing")), BAD, r"bundle/tokenizer\.json: missing \(listed in uqff_report\.json\)"),
    ("config-symlink-outside", bd(at("config.json", "outside")), BAD, outside_link("bundle", "config.json")),
    ("config-layers-1e9", bd(at("config.json", lambda p: edit_json(p, {"num_hidden_layers": 10**9})), update_report=True), BAD,
     r"bundle/config\.json: 'num_hidden_layers' must be an integer in \[1, 1024\], got 1000000000"),
    ("config-layers-1e9-info", bd(at("config.json", lambda p: edit_json(p, {"num_hidden_layers": 10**9})), update_report=True, cmd="info"), EITHER),
    ("config-top-k-0", bd(at("config.json", lambda p: edit_json(p, {"num_experts_per_tok": 0})), update_report=True), BAD,
     r"bundle/config\.json: 'num_experts_per_tok' must be an integer in \[1, 4096\], got 0"),
    ("config-hidden-size-128", bd(at("config.json", lambda p: edit_json(p, {"hidden_size": 128})), update_report=True), BAD,
     r"bundle/residual\.safetensors: tensor 'model\.embed_tokens\.weight' has shape \[8192, 64\], the config implies \[8192, 128\]"),
    ("config-not-utf8", bd(at("config.json", b'{"architectures": ["\xff"]}'), update_report=True), BAD,
     r"bundle/config\.json: not UTF-8 text \(byte 0xff at offset 20\)"),
    ("config-list", bd(at("config.json", b"[]"), update_report=True), BAD, r"bundle/config\.json: expected a JSON object, found a list"),
    ("genconfig-fifo-unlisted", bd(at("generation_config.json", "fifo")), BAD, r"bundle/generation_config\.json: is a FIFO, not a regular file"),
    ("genconfig-list-listed", bd(asset_listed("generation_config.json", b"[]"), update_report=True), BAD,
     r"bundle/generation_config\.json: expected a JSON object, found a list"),
    ("tokconfig-list-listed", bd(asset_listed("tokenizer_config.json", b"[]"), update_report=True), BAD,
     r"bundle/tokenizer_config\.json: expected a JSON object, found a list"),
    ("policy-mismatch", lambda ctx: generate(ctx, ctx.bundle(), "--experts", "int2"), BAD,
     r"bundle: the bundle was quantized with policy 'moqe:int4-g64', not 'moqe:int2-g64' \(a bundle is never requantized"),
    ("requantize-bundle", lambda ctx: quantize(ctx, ctx.bundle(), ctx.dir / "again"), BAD,
     r"bundle: is a UQFF bundle; quantize from the original checkpoint instead \(a bundle is never requantized\)"),
])


# ---- CLI flags ------------------------------------------------------------------------------------------------
def binary_text(ctx: Ctx) -> Run:
    return cli("--text", str(ctx.text(bytes(range(256)) * 64, "weights.bin")), cmd="perplexity")(ctx)


def fifo_text(ctx: Ctx) -> Run:
    p = ctx.dir / "text.fifo"
    os.mkfifo(p)
    return cli("--text", str(p), cmd="perplexity")(ctx)


def directory_text(ctx: Ctx) -> Run:
    (ctx.dir / "texts").mkdir()
    return cli("--text", str(ctx.dir / "texts"), cmd="perplexity")(ctx)


def text_path(path: str):
    return lambda ctx: cli("--text", path, cmd="perplexity")(ctx)


CLI = rows("cli", [
    ("valid-generate", cli(), VALID),
    ("valid-generate-bundled-model", cli(model="data"), VALID),
    ("temperature-nan", cli("--temperature", "nan"), BAD, r"temperature must be a finite number in \[0, 100\] \(0 = greedy\), got nan"),
    ("temperature-nan-bundled-model", cli("--temperature", "nan", model="data"), BAD,
     r"temperature must be a finite number in \[0, 100\] \(0 = greedy\), got nan"),
    ("temperature-inf", cli("--temperature", "inf"), BAD, r"temperature must be a finite number in \[0, 100\] \(0 = greedy\), got inf"),
    ("temperature-1e309", cli("--temperature", "1e309"), BAD, r"temperature must be a finite number in \[0, 100\] \(0 = greedy\), got inf"),
    ("temperature-minus-1", cli("--temperature", "-1"), BAD, r"temperature must be a finite number in \[0, 100\] \(0 = greedy\), got -1\.0"),
    ("seed-minus-1", cli("--seed", "-1", "--temperature", "0.8"), BAD, r"seed must be a whole number in \[0, 9223372036854775807\], got -1"),
    ("seed-2^64", cli("--seed", str(2**64), "--temperature", "0.8"), EITHER),
    ("seed-10^30", cli("--seed", str(10**30), "--temperature", "0.8"), EITHER),
    # message to improve: argparse prints its usage lines first (also max-new-tokens-word, no-command, unknown-command)
    ("seed-fraction", cli("--seed", "1.5"), BAD, r"argument --seed: invalid int value: '1\.5'"),
    ("repetition-penalty-nan", cli("--repetition-penalty", "nan"), BAD, r"repetition_penalty must be a finite number in \(0, 100\], got nan"),
    ("repetition-penalty-inf", cli("--repetition-penalty", "inf"), BAD, r"repetition_penalty must be a finite number in \(0, 100\], got inf"),
    ("repetition-penalty-0", cli("--repetition-penalty", "0"), BAD, r"repetition_penalty must be a finite number in \(0, 100\], got 0\.0"),
    ("top-p-2", cli("--top-p", "2", "--temperature", "0.8"), BAD, r"top_p must be a number in \(0, 1\], got 2\.0"),
    ("top-p-0", cli("--top-p", "0", "--temperature", "0.8"), BAD, r"top_p must be a number in \(0, 1\], got 0\.0"),
    ("top-p-nan", cli("--top-p", "nan", "--temperature", "0.8"), BAD, r"top_p must be a number in \(0, 1\], got nan"),
    ("top-k-minus-1", cli("--top-k", "-1", "--temperature", "0.8"), BAD, r"top_k must be a whole number in \[0, 16777216\], got -1"),
    ("top-k-beyond-vocab", cli("--top-k", "100000", "--temperature", "0.8"), EITHER),
    ("max-new-tokens-minus-1", cli("--max-new-tokens", "-1"), BAD, r"max_new_tokens must be a whole number in \[0, 16777216\], got -1"),
    ("max-new-tokens-0", cli("--max-new-tokens", "0"), EITHER),
    ("max-new-tokens-10^12", cli("--max-new-tokens", str(10**12), "--ignore-eos"), BAD,
     r"max_new_tokens must be a whole number in \[0, 16777216\], got 1000000000000"),
    ("max-new-tokens-word", cli("--max-new-tokens", "many"), BAD, r"argument --max-new-tokens: invalid int value: 'many'"),
    ("prompt-invalid-utf8", cli("--prompt", b"It is \xff\xfe the"), EITHER),
    ("prompt-empty", cli("--prompt", ""), EITHER),
    ("prompt-beyond-context", cli("--prompt", "the " * 200), BAD, r"prompt of 202 tokens \+ 2 new tokens exceeds the context of 64 tokens"),
    ("perplexity-binary-file", binary_text, BAD, r"weights\.bin: not UTF-8 text \(byte 0x80 at offset 128\); give a plain text file"),
    ("perplexity-directory", directory_text, BAD, r"/texts: is a directory, not a regular text file"),
    ("perplexity-missing-file", text_path("/nonexistent/heldout.txt"), BAD, r"/nonexistent/heldout\.txt: no such text file"),
    ("perplexity-empty-file", lambda ctx: text_path(str(ctx.text("", "empty.txt")))(ctx), BAD, r"empty\.txt: 1 token\(s\); perplexity needs at least two"),
    ("perplexity-fifo", fifo_text, BAD, r"text\.fifo: is a FIFO, not a regular text file"),
    ("perplexity-window-minus-5", cli("--window", "-5", cmd="perplexity"), BAD, r"--window must be >= 0, got -5"),
    ("perplexity-window-beyond-context", cli("--window", "100000", cmd="perplexity"), BAD, r"--window 100000 exceeds the model's context of 64 tokens \(max_position_embeddings\)"),
    ("perplexity-stride-minus-1", cli("--stride", "-1", cmd="perplexity"), BAD, r"--stride must be >= 0, got -1"),
    ("perplexity-max-tokens-minus-1", cli("--max-tokens", "-1", cmd="perplexity"), BAD, r"--max-tokens must be >= 0, got -1"),
    ("quantize-out-root", lambda ctx: Run(quantize(ctx, ctx.tiny(), "/").argv, isolate=True), BAD,
     r"error: /: contains the source checkpoint \S*/model; write the bundle to a separate folder"),
    ("experts-int9", cli("--experts", "int9"), BAD, r"unknown format 'int9'; known: f32, f16, bf16, int8, fp8, int4, int3, int2, q8_0, q4_0"),
    ("experts-empty", cli("--experts", ""), EITHER),
    ("experts-int4-g7", cli("--experts", "int4-g7"), BAD, r"format 'int4' does not take group size 7; allowed: 32, 64, 128"),
    ("kv-cache-q5", cli("--kv-cache", "q5"), BAD, r"unknown KV cache type 'q5'; choose one of f32, q8_0, q4_0"),
    ("kv-cache-half-spec", cli("--kv-cache", "k=q8_0", model="data"), EITHER),
    ("kv-cache-unknown-side", cli("--kv-cache", "k=q8_0,x=q4_0", model="data"), BAD, r"KV cache spec 'k=q8_0,x=q4_0': use 'q8_0' or 'k=q8_0,v=q4_0'"),
    ("kv-cache-q4-on-head-dim-16", cli("--kv-cache", "q4_0"), BAD,
     r"KV cache type 'q4_0' needs a head dim divisible by 32; this model's head dim is 16"),
    ("shard-size-0", lambda ctx: quantize(ctx, ctx.tiny(), ctx.dir / "out", "--shard-size", "0"), BAD, r"shard size must be positive, got 0"),
    ("shard-size-negative", lambda ctx: quantize(ctx, ctx.tiny(), ctx.dir / "out", "--shard-size", "-1"), BAD,
     r"bad size '-1' \(e\.g\. 10GiB, 512MiB, 1000000\)"),
    ("shard-size-1e400", lambda ctx: quantize(ctx, ctx.tiny(), ctx.dir / "out", "--shard-size", "1e400"), BAD,
     r"bad size '1e400' \(e\.g\. 10GiB, 512MiB, 1000000\)"),
    ("override-without-format", cli("--experts", "int4", "--override", "down"), BAD,
     r"override 'down' must look like REGEX=FORMAT \(e\.g\. 'down=int8'\)"),
    ("override-empty-regex", cli("--experts", "int4", "--override", "=int4"), BAD,
     r"override '=int4' must look like REGEX=FORMAT \(e\.g\. 'down=int8'\)"),
    ("override-bad-regex", cli("--experts", "int4", "--override", "[=int4"), BAD,
     r"override '\[=int4': bad regular expression \(unterminated character set"),
    ("override-bad-format", cli("--experts", "int4", "--override", "down=int9"), BAD,
     r"unknown format 'int9'; known: f32, f16, bf16, int8, fp8, int4, int3, int2, q8_0, q4_0"),
    ("backend-cuda-without-gpu", cli("--backend", "cuda"), EITHER),
    ("model-missing-dir", argv("generate", "--model", "/nonexistent/model", "--prompt", PROMPT), BAD, r"/nonexistent"),
    ("model-is-a-file", lambda ctx: Run(["generate", "--model", str(ctx.text()), "--prompt", PROMPT]), BAD, r"text\.txt: "),
    ("model-empty-string", argv("generate", "--model", "", "--prompt", PROMPT), BAD, r"--model is empty; give a model folder"),
    ("inspect-not-a-bundle", lambda ctx: inspect(ctx, ctx.tiny()), BAD,
     r"model: not a complete UQFF bundle \(no uqff_report\.json; an interrupted save or not a bundle\)"),
    ("inspect-a-file", lambda ctx: inspect(ctx, ctx.text()), BAD, r"text\.txt: is a file, not a folder"),
    ("no-command", argv(), BAD, r"moqe: error: the following arguments are required: command"),
    ("unknown-command", argv("bogus"), BAD, r"moqe: error: argument command: invalid choice: 'bogus' \(choose from 'formats', 'generate'"),
])


# ---- quantize --out: where a bundle may be written ------------------------------------------------------------
def user_files(d: Path) -> Path:
    """A folder of the user's own files (a note, a table, a hidden file, a file that looks like a shard)."""
    (d / "data").mkdir(parents=True, exist_ok=True)
    (d / "notes.txt").write_text("my notes\n")
    (d / "data" / "table.csv").write_text("a,b\n1,2\n")
    (d / ".hidden").write_bytes(os.urandom(64))
    return d


def save_onto_user_folder(ctx: Ctx) -> Run:
    m, out = ctx.tiny(), user_files(ctx.dir / "work")
    ctx.protect(m, out)
    return quantize(ctx, m, out)


def save_onto_folder_with_uqff_file(ctx: Ctx) -> Run:
    """A folder that holds a file named *.uqff (no report): not a bundle this toolkit wrote."""
    m, out = ctx.tiny(), user_files(ctx.dir / "work")
    (out / "mine.uqff").write_bytes(os.urandom(100))
    ctx.protect(m, out)
    return quantize(ctx, m, out)


def save_onto_model(ctx: Ctx) -> Run:
    m = ctx.tiny()
    ctx.protect(m)
    return quantize(ctx, m, m)


def save_onto_model_parent(ctx: Ctx) -> Run:
    p = user_files(ctx.dir / "p")
    m = ctx.tiny("p/model")
    ctx.protect(p)
    return quantize(ctx, m, p)


def save_onto_model_parent_dotdot(ctx: Ctx) -> Run:
    m = ctx.tiny("p/model")
    ctx.protect(ctx.dir / "p")
    return quantize(ctx, m, f"{m}/..")


def save_into_model(ctx: Ctx) -> Run:
    m = ctx.tiny()
    ctx.protect(m)
    return quantize(ctx, m, m / "bundle")


def save_onto_symlink_to_user_folder(ctx: Ctx) -> Run:
    m, target = ctx.tiny(), user_files(ctx.dir / "mine")
    (ctx.dir / "link").symlink_to(target)
    ctx.protect(m, target)
    return quantize(ctx, m, ctx.dir / "link")


def save_onto_bundle(ctx: Ctx) -> Run:
    m, b = ctx.tiny(), ctx.bundle()
    ctx.protect(m)
    return quantize(ctx, m, b)


def save_onto_empty_folder(ctx: Ctx) -> Run:
    m, out = ctx.tiny(), ctx.dir / "empty"
    out.mkdir()
    ctx.protect(m)
    return quantize(ctx, m, out)


def save_onto_file(ctx: Ctx) -> Run:
    m, out = ctx.tiny(), ctx.text("my text\n", "notes.txt")
    ctx.protect(m, out)
    return quantize(ctx, m, out)


def save_onto_root(ctx: Ctx) -> Run:
    m = ctx.tiny()
    ctx.protect(m)
    return Run(quantize(ctx, m, "/").argv, isolate=True)


def save_under_readonly_parent(ctx: Ctx) -> Run:
    m, parent = ctx.tiny(), ctx.dir / "ro"
    parent.mkdir()
    ctx.make_readonly(parent)
    ctx.protect(m)
    return quantize(ctx, m, parent / "bundle")


def save_onto_bundle_under_readonly_parent(ctx: Ctx) -> Run:
    m, b = ctx.tiny(), ctx.bundle("ro/bundle")
    ctx.make_readonly(ctx.dir / "ro")
    ctx.protect(m, b)
    return quantize(ctx, m, b)


def interrupted_save_over_bundle(ctx: Ctx) -> Run:
    """The writer is killed after shard 0; the previous bundle must survive and load."""
    m, b = ctx.tiny(), ctx.bundle()
    ctx.protect(m, b)
    run = quantize(ctx, m, b, "--shard-size", "20000")
    return Run(run.argv, env={"MOQE_UQFF_KILL_AFTER_SHARD": "0"}, then=["uqff", "inspect", str(b)])


def interrupted_then_saved_again(ctx: Ctx) -> Run:
    """After an interrupted save, the same save completes (the stale staging folder is no obstacle)."""
    m, out = ctx.tiny(), ctx.dir / "out"
    ctx.protect(m)
    run = quantize(ctx, m, out, "--shard-size", "20000")
    return Run(run.argv, env={"MOQE_UQFF_KILL_AFTER_SHARD": "0"}, then=run.argv)


def interrupted_first_save(ctx: Ctx) -> Run:
    """Killed while writing a new bundle: OUT must not look like a bundle afterwards."""
    m, out = ctx.tiny(), ctx.dir / "out"
    ctx.protect(m)
    run = quantize(ctx, m, out, "--shard-size", "20000")
    return Run(run.argv, env={"MOQE_UQFF_KILL_AFTER_SHARD": "0"}, then=["generate", "--model", str(out), "--prompt", PROMPT])


SAVE = rows("save", [
    ("onto-user-folder", save_onto_user_folder, BAD,
     r"work: exists and is not a UQFF bundle written by this toolkit \(it holds \.hidden, data, notes\.txt\); refusing to replace it"),
    ("onto-folder-with-uqff-named-file", save_onto_folder_with_uqff_file, BAD,
     r"work: exists and is not a UQFF bundle written by this toolkit \(it holds \.hidden, data, mine\.uqff, notes\.txt\); refusing"),
    ("onto-model-folder", save_onto_model, BAD, r"/model: is the source checkpoint \S*/model; write the bundle to a separate folder"),
    ("onto-model-parent", save_onto_model_parent, BAD, r"/p: contains the source checkpoint \S*/p/model; write the bundle to a separate folder"),
    ("onto-model-parent-dotdot", save_onto_model_parent_dotdot, BAD,
     r"/p/model/\.\.: contains the source checkpoint \S*/p/model; write the bundle to a separate folder"),
    ("into-model-folder", save_into_model, BAD, r"/model/bundle: lies inside the source checkpoint \S*/model; write the bundle to a separate folder"),
    ("onto-symlink-to-user-folder", save_onto_symlink_to_user_folder, BAD, r"/link: is a symbolic link; give the real folder \(or a new one\)"),
    ("onto-file", save_onto_file, BAD, r"/notes\.txt: exists and is not a directory"),
    ("onto-root", save_onto_root, BAD, r"error: /: contains the source checkpoint \S*/model; write the bundle to a separate folder"),
    ("under-readonly-parent", save_under_readonly_parent, BAD, r"/ro: cannot write the bundle there \((Operation not permitted|Permission denied)\)"),
    ("onto-bundle-under-readonly-parent", save_onto_bundle_under_readonly_parent, BAD,
     r"/ro: cannot write the bundle there \((Operation not permitted|Permission denied)\)"),
    ("onto-existing-bundle", save_onto_bundle, VALID),
    ("onto-empty-folder", save_onto_empty_folder, VALID),
    ("interrupted-over-bundle", interrupted_save_over_bundle, VALID),
    ("interrupted-then-saved-again", interrupted_then_saved_again, VALID),
    ("interrupted-first-save", interrupted_first_save, BAD, r"/out: no such folder"),
])


# ---- app handlers ---------------------------------------------------------------------------------------------
SLOTS = ["none", "moqe", "f32"] * 4  # four configuration rows of the page (the first n used)


def app_call(handler: str, *args, source: str = "tiny", prepare=None):
    """A call of ``app.handlers.<handler>(settings, cache, source, *args)`` on the tiny checkpoint, the output
    root being ``ctx.dir/out``; ``prepare(ctx, root)`` may plant files under the root (and protect them) and
    returns replacements for ``args`` (or None)."""
    def setup(ctx: Ctx) -> Run:
        model = ctx.tiny()
        root = ctx.dir / "out"
        root.mkdir()
        ctx.protect(model)
        call_args = list(args)
        if prepare:
            call_args = prepare(ctx, root) or call_args
        src = {"tiny": str(model), "bundle": lambda: str(ctx.bundle("out/b0"))}[source]
        src = src() if callable(src) else src
        settings = {"model": str(model), "output_root": str(root), "heldout": str(ctx.fx.heldout), "cache_size": 1}
        lead = [] if handler == "load_bundle" else [src]
        return Run(app={"handler": handler, "args": lead + call_args, "settings": settings})
    return setup


def compare(prompt=PROMPT, max_new=2, temperature=0.7, seed=1234, n=2, slots=SLOTS):
    return app_call("compare", n, *slots, prompt, max_new, temperature, seed)


def measure(n_tokens=16):
    return app_call("measure", 2, *SLOTS, n_tokens)


def save_as(name, preset="moqe", fmt="int4", prepare=None, source="tiny"):
    return app_call("quantize_save", preset, fmt, name, prepare=prepare, source=source)


def victim_folder(ctx: Ctx, root: Path) -> None:
    ctx.protect(user_files(root / "victim"))


def victim_behind_symlink(ctx: Ctx, root: Path) -> None:
    target = user_files(ctx.dir / "elsewhere")
    (root / "link").symlink_to(target)
    ctx.protect(target)


def file_under_root(ctx: Ctx, root: Path) -> None:
    (root / "notes.txt").write_text("mine\n")
    ctx.protect(root / "notes.txt")


def existing_bundle(ctx: Ctx, root: Path) -> None:
    ctx.bundle("out/b1")


def outside_absolute(ctx: Ctx, root: Path) -> list:
    target = user_files(ctx.dir / "elsewhere")
    ctx.protect(target)
    return ["moqe", "int4", str(target)]


APP = rows("app", [
    ("valid-compare", compare(), VALID),
    ("valid-measure", measure(), VALID),
    ("valid-save", save_as("b1"), VALID),
    ("valid-save-over-own-bundle", save_as("b1", prepare=existing_bundle), VALID),
    # save names
    ("save-name-300-chars", save_as("a" * 300), BAD, r"each folder name in the bundle path is limited to 255 bytes"),
    ("save-name-250-chars", save_as("a" * 250), EITHER),
    ("save-name-nul", save_as("a\x00b"), BAD, r"a bundle name has at most 1000 printable characters \(no NUL or control characters\)"),
    ("save-name-dotdot", save_as("../escape"), BAD, r"'\.\./escape' is outside the output root \S*/out; give a directory inside it"),
    ("save-name-absolute", save_as("/etc"), BAD, r"'/etc' is outside the output root \S*/out; give a directory inside it"),
    ("save-name-absolute-user-folder", save_as("x", prepare=outside_absolute), BAD,
     r"'/\S+/elsewhere' is outside the output root \S*/out; give a directory inside it"),
    ("save-name-empty", save_as(""), BAD, r"give a bundle directory name under the output root"),
    ("save-name-blank", save_as("   "), BAD, r"give a bundle directory name under the output root"),
    ("save-name-dot", save_as("."), BAD, r"'\.' is .*the output root"),
    ("save-name-user-folder", save_as("victim", prepare=victim_folder), BAD,
     r"out/victim: exists and is not a UQFF bundle written by this toolkit \(it holds \.hidden, data, notes\.txt\); refusing"),
    ("save-name-user-folder-dotdot", save_as("sub/../victim", prepare=victim_folder), BAD,
     r"out/victim: exists and is not a UQFF bundle written by this toolkit \(it holds \.hidden, data, notes\.txt\); refusing"),
    ("save-name-symlink-to-user-folder", save_as("link", prepare=victim_behind_symlink), BAD,
     r"'link' is outside the output root \S*/out; give a directory inside it"),
    ("save-name-existing-file", save_as("notes.txt", prepare=file_under_root), BAD, r"out/notes\.txt: exists and is not a directory"),
    ("save-name-newline", save_as("a\nb"), EITHER),
    ("save-name-number", save_as(123), EITHER),
    ("save-format-int9", save_as("b1", fmt="int9"), BAD, r"unknown format 'int9'; known: f32, f16, bf16, int8, fp8, int4, int3, int2, q8_0, q4_0"),
    ("save-format-none", save_as("b1", fmt=None), BAD, r"policy 'moqe' needs a format \(e\.g\. int4, int3-g64, fp8\)"),
    ("save-policy-none", save_as("b1", preset="none"), BAD, r"unknown policy 'none'; choose moqe or all-linear"),
    ("save-from-bundle", save_as("b2", source="bundle"), BAD, r"the model in use \(b0\) is a UQFF bundle; switch to the base model to quantize"),
    # compare: numbers and prompts
    ("compare-seed-nan", compare(seed=float("nan")), BAD, r"seed must be a whole number in \[0, 4294967295\], got nan"),
    ("compare-seed-inf", compare(seed=float("inf")), BAD, r"seed must be a whole number in \[0, 4294967295\], got inf"),
    ("compare-seed-minus-1", compare(seed=-1), BAD, r"seed must be a whole number in \[0, 4294967295\], got -1"),
    ("compare-seed-2^64", compare(seed=2**64), BAD, r"seed must be a whole number in \[0, 4294967295\], got 18446744073709551616"),
    ("compare-seed-word", compare(seed="abc"), BAD, r"seed must be a number, got 'abc'"),
    ("compare-max-new-nan", compare(max_new=float("nan")), BAD, r"max new tokens must be a whole number in \[1, 63\], got nan"),
    ("compare-max-new-inf", compare(max_new=float("inf")), BAD, r"max new tokens must be a whole number in \[1, 63\], got inf"),
    ("compare-max-new-minus-1", compare(max_new=-1), BAD, r"max new tokens must be a whole number in \[1, 63\], got -1"),
    ("compare-max-new-10^9", compare(max_new=10**9), BAD, r"max new tokens must be a whole number in \[1, 63\], got 1000000000"),
    ("compare-temperature-nan", compare(temperature=float("nan")), BAD, r"temperature must lie in \[0, 5\], got nan"),
    ("compare-temperature-inf", compare(temperature=float("inf")), BAD, r"temperature must lie in \[0, 5\], got inf"),
    ("compare-temperature-minus-1", compare(temperature=-1), BAD, r"temperature must lie in \[0, 5\], got -1\.0"),
    ("compare-temperature-word", compare(temperature="hot"), BAD, r"temperature must be a number, got 'hot'"),
    ("compare-prompt-empty", compare(prompt=""), BAD, r"the prompt is empty; type a few words to continue"),
    ("compare-prompt-none", compare(prompt=None), BAD, r"the prompt is empty; type a few words to continue"),
    ("compare-prompt-30000-chars", compare(prompt="a" * 30_000), BAD, r"the prompt has 30000 characters; the limit is 20000"),
    ("compare-prompt-beyond-context", compare(prompt="the " * 200), BAD,
     r"the prompt is 202 tokens; with 2 new tokens that exceeds the context of 64 tokens"),
    ("compare-prompt-lone-surrogate", compare(prompt="It is \udcff"), EITHER),
    ("compare-n-nan", compare(n=float("nan")), BAD, r"number of configurations must be 2, 3 or 4, got nan"),
    ("compare-n-5", compare(n=5), BAD, r"number of configurations must be 2, 3 or 4, got 5"),
    ("compare-format-int9", compare(slots=["int9", "moqe", "f32"] * 4), BAD,
     r"unknown expert format 'int9'; choose one of none, int8, fp8, int4, int3, int2"),
    # measure, load
    ("measure-tokens-nan", measure(float("nan")), BAD, r"held-out tokens must be a whole number in \[16, 65536\], got nan"),
    ("measure-tokens-inf", measure(float("inf")), BAD, r"held-out tokens must be a whole number in \[16, 65536\], got inf"),
    ("measure-tokens-minus-1", measure(-1), BAD, r"held-out tokens must be a whole number in \[16, 65536\], got -1"),
    ("measure-tokens-10^12", measure(10**12), BAD, r"held-out tokens must be a whole number in \[16, 65536\], got 1000000000000"),
    ("load-name-dotdot", app_call("load_bundle", "../x"), BAD, r"'\.\./x' is outside the output root \S*/out; give a directory inside it"),
    ("load-name-nul", app_call("load_bundle", "a\x00b"), BAD,
     r"a bundle name has at most 1000 printable characters \(no NUL or control characters\)"),
    ("load-name-300-chars", app_call("load_bundle", "a" * 300), BAD, r"each folder name in the bundle path is limited to 255 bytes"),
    ("load-name-missing", app_call("load_bundle", "missing"), BAD, r"no UQFF bundle at \S*/out/missing"),
])


TABLES = {"checkpoint": CHECKPOINT, "bundle": BUNDLE, "cli": CLI, "save": SAVE, "app": APP}
CASES = [c for table in TABLES.values() for c in table]
assert len({(c.kind, c.id) for c in CASES}) == len(CASES), "duplicate case ids"
