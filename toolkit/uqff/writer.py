"""Write a UQFF bundle: quantize a checkpoint with a policy (streaming, expert by expert), then write
sorted, capped shards, ``residual.safetensors``, the copied JSON assets and the report, all into a
staging folder next to OUT that is published (swapped in) only when complete and fsynced."""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import stat
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import ModelError
from ..files import Folder
from ..formats import QTensor
from ..formats.mixed import MixedExperts
from ..model import Checkpoint, load_config, load_weights
from ..model.inspect import check_fits
from ..model.safetensors_io import NAMES
from ..quant import QuantReport, quantizing_transform
from . import spec
from .families import FAMILIES, encode
from .keys import expert_keys, layer_keys, split_rows
from .reader import is_bundle, read_report
from .spec import UQFFError, crc32_file


def write_safetensors(path: Path, items: list[tuple[str, np.ndarray]], metadata: dict | None = None) -> int:
    """Write tensors in the given order (no temporary file: the staging folder is the atomic unit); fsync.
    ``metadata``: the header's ``__metadata__`` (string to string)."""
    header, offset = ({"__metadata__": dict(metadata)} if metadata else {}), 0
    items = [(name, np.array(a, order="C", copy=not np.asarray(a).flags.c_contiguous)) for name, a in items]  # 0-d kept
    for name, a in items:
        header[name] = {"dtype": NAMES[np.dtype(a.dtype)], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, a in items:
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(blob) + offset


# what mistral.rs puts in each shard's header (it ignores what it does not know; so do we)
SHARD_METADATA = {"uqff.producer": "moqe-toolkit", "uqff.version": ".".join(map(str, spec.VERSION))}


def mistralrs_report(shard_rows: list, layer_rows: list, policy: str) -> dict:
    """The fields of mistral.rs's own report (its schema 1), written beside ours so that mistral.rs loads the
    bundle on its own: the two schemas share no key, and each reader ignores the other's. Layers in our own
    families (tags >= 100) are listed too; mistral.rs refuses them when it reads their format tag."""
    counts: dict[str, int] = {}
    for r in layer_rows:
        counts[r["format"]] = counts.get(r["format"], 0) + 1
    quant = max(counts, key=counts.get) if counts else "none"
    return {"schema": 1, "generated_by": {"tool": "moqe-toolkit", "mistralrs_version": "0.9.5", "git_revision": policy},
            "uqff_version": ".".join(map(str, spec.VERSION)),
            "outputs": [{"quant": quant, "shards": [s["file"] for s in shard_rows], "layers": len(layer_rows),
                         "actual_counts": counts, "fallback_count": 0,
                         "layer_details": [{"module": r["key"], "default_target": r["format"], "resolved_target": r["format"],
                                            "stored": r["format"], "shape": r["shape"]} for r in layer_rows]}]}


def _compact(a: np.ndarray) -> np.ndarray:
    """Store a full-precision tensor in f16 or bf16 when that is exact (the checkpoint's own dtype), else f32."""
    a = np.asarray(a, np.float32)
    for dt in (np.float16, ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):
            b = a.astype(dt)
        if np.array_equal(b.astype(np.float32), a):
            return b
    return a


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE) where the kernel and libc have it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0


def publish(staging: Path, out: Path) -> None:
    """Swap the complete staging folder in as ``out``; the previous bundle (if any) is removed afterwards."""
    if out.exists() and not out.is_dir():
        raise UQFFError(f"{out}: exists and is not a directory")
    if not out.exists():
        os.rename(staging, out)
    elif _exchange(staging, out):  # staging now holds the previous bundle
        shutil.rmtree(staging)
    else:  # fallback: two renames (a crash between them leaves the previous bundle at old)
        old = out.with_name(f".{out.name}.uqff-old-{os.getpid()}")
        os.rename(out, old)
        os.rename(staging, out)
        shutil.rmtree(old)
    _fsync_dir(out.parent)


def _ours(out: Path) -> set[str] | None:
    """The entries of a bundle this toolkit wrote and that verifies as written: its report, and the files the
    report lists, each a regular file (not a link, not a folder) of the listed size and CRC-32. None otherwise:
    a report is never taken at its word, since replacing the bundle deletes what it lists."""
    from ..files import check_name

    try:
        report = read_report(out)
    except ModelError:
        return None
    if report.get("writer") != "moqe-toolkit" or not report["_files"]:
        return None
    for name, (size, crc) in report["_files"].items():
        try:
            check_name(name, str(out))
            st = os.lstat(out / name)
        except (ModelError, OSError):
            return None
        if "/" in name or not stat.S_ISREG(st.st_mode) or st.st_size != size or crc32_file(out / name) != crc:
            return None
    return {spec.REPORT, *report["_files"]}


def check_out(out: Path, model_dir: Path, inputs=()) -> None:
    """Refuse an output folder whose replacement would delete what this toolkit did not write (the write rule,
    :mod:`toolkit.writes`, for a bundle folder).

    ``out`` must be absent, an empty folder, or a bundle this toolkit wrote that verifies (:func:`_ours`) and
    holds nothing else; it must neither be, contain nor lie inside the source checkpoint or another input
    (``inputs``: (path, role) pairs)."""
    from ..writes import WriteError, check_not_input

    if not str(out).strip():
        raise UQFFError("--out is empty; give the folder to write the bundle to")
    try:
        check_not_input(out, [(model_dir, "the source checkpoint"), *inputs], "bundle")
    except WriteError as e:
        raise UQFFError(str(e)) from None
    if not os.path.lexists(out):
        return
    if out.is_symlink():
        raise UQFFError(f"{out}: is a symbolic link; give the real folder (or a new one)")
    if not out.is_dir():
        raise UQFFError(f"{out}: exists and is not a directory")
    try:
        present = sorted(p.name for p in out.iterdir())
    except OSError as e:
        raise UQFFError(f"{out}: cannot list ({e.strerror or e})") from None
    if not present:
        return
    ours = _ours(out)
    if ours is None:
        shown = ", ".join(present[:5]) + (f" and {len(present) - 5} more" if len(present) > 5 else "")
        raise UQFFError(f"{out}: exists and is not a UQFF bundle written by this toolkit (it holds {shown}); "
                        f"refusing to replace it: give a new or empty folder")
    extra = [name for name in present if name not in ours]
    if extra:
        raise UQFFError(f"{out}: is a bundle, but also holds {', '.join(extra[:5])} that the bundle did not write; "
                        f"refusing to replace it (move those files, or give another folder)")


def collect(model_dir, policy, backend: str = "numba", progress=None, allow_outside: bool = False):
    """Quantize ``model_dir`` with ``policy`` -> (layers {key: (QTensor, tag, entries)}, residual {name: array}, QuantReport)."""
    cfg = load_config(model_dir, allow_outside)
    policy, _ = policy.fit(cfg)
    check_fits(cfg, policy, Path(model_dir) / spec.CONFIG)
    ck = Checkpoint(model_dir, allow_outside)
    qreport = QuantReport(policy.label)
    transform = quantizing_transform(policy, backend, qreport)
    layers: dict[str, tuple] = {}
    residual: dict[str, np.ndarray] = {}

    def record(role, name, load, shape, layer=None):
        out = transform(role, name, load, shape, layer)
        keys, names = layer_keys(role, name)
        if isinstance(out, MixedExperts):  # experts at mixed widths: a layer per expert and projection
            for e in range(out.shape[0]):
                for key, part in zip(expert_keys(keys, e), split_rows(out.expert(e), len(keys))):
                    if part.fmt.quantized:
                        tag, entries = encode(part)
                        layers[key] = (part, tag, entries)
                    else:  # an expert the policy keeps in full precision
                        residual[key + ".weight"] = _compact(part.dequantize("numpy"))
            return None
        for key, rname, part in zip(keys, names, split_rows(out, len(keys))):
            if isinstance(part, QTensor):
                tag, entries = encode(part)
                layers[key] = (part, tag, entries)
            else:
                residual[rname] = _compact(part)
        return None

    load_weights(ck, cfg, transform=record, progress=progress)
    residual["model.norm.weight"] = _compact(ck.get_f32("model.norm.weight"))  # read outside any transform
    return layers, residual, qreport


def plan_shards(layers: dict, shard_bytes: int) -> list[list[str]]:
    """Layer keys in sorted order, cut into shards of at most ``shard_bytes`` (a layer is never split)."""
    shards, cur, size = [], [], 0
    for key in sorted(layers):
        n = sum(a.nbytes for a in layers[key][2].values())
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += n
    if cur or not shards:
        shards.append(cur)
    return shards


def _remove_stale_staging(out: Path) -> None:
    """Delete staging folders of OUT left by saves whose process no longer exists (killed mid-write)."""
    for p in out.parent.glob(f".{out.name}{spec.STAGING_PREFIX}*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


def save_bundle(model_dir, out_dir, policy, shard_bytes: int = spec.DEFAULT_SHARD_BYTES, backend: str = "numba",
                progress=None, allow_outside: bool = False, host=None) -> dict:
    """Quantize ``model_dir`` with ``policy`` and write the bundle ``out_dir`` atomically; returns the report.
    ``out_dir`` must be new, empty, or a bundle this toolkit wrote (:func:`check_out`); it is replaced only
    once the new bundle is complete. ``host [L, E]`` (a joint plan's places): saved in the report as
    ``"placement": {"host": {"LAYER": [experts]}}``, the places a device load takes when given none."""
    model_dir, out = Path(model_dir), Path(out_dir)
    if shard_bytes <= 0:
        raise UQFFError(f"shard size must be positive, got {shard_bytes}")
    source = Folder(model_dir, allow_outside)
    for name in spec.REQUIRED_ASSETS:
        if not source.exists(name):
            raise ModelError(f"{model_dir}: no {name} to copy into the bundle")
        source.path(name)
    check_out(out, model_dir)
    if is_bundle(model_dir):
        raise UQFFError(f"{model_dir}: is a UQFF bundle; quantize from the original checkpoint instead "
                        f"(a bundle is never requantized)")
    codec_backend = "numpy" if backend == "numpy" else "numba"
    layers, residual, qreport = collect(model_dir, policy, codec_backend, progress, allow_outside)

    staging = out.parent / f".{out.name}{spec.STAGING_PREFIX}{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(out)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    except OSError as e:
        raise UQFFError(f"{out.parent}: cannot write the bundle there ({e.strerror or e})") from None
    try:
        report = _write(staging, source, layers, residual, qreport, policy, shard_bytes, codec_backend, host)
        _fsync_dir(staging)
        check_out(out, model_dir)  # again: the folder may have changed while we quantized
        publish(staging, out)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise UQFFError(f"{out}: writing the bundle failed ({e.strerror or e}); nothing was replaced") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _write(staging: Path, source: Folder, layers, residual, qreport, policy, shard_bytes, backend, host=None) -> dict:
    files: dict[str, dict] = {}
    version = [(k, np.array(v, np.uint32)) for k, v in zip(spec.VERSION_KEYS, spec.VERSION)]
    shard_rows, layer_rows = [], []
    kill_after = os.environ.get(spec.KILL_AFTER_SHARD_ENV)
    for n, keys in enumerate(plan_shards(layers, shard_bytes)):
        fname = f"{spec.SHARD_STEM}-{n}{spec.SHARD_SUFFIX}"
        items = list(version)
        for key in keys:
            qt, tag, entries = layers[key]
            items += [(key + suffix, entries[suffix]) for suffix in sorted(entries)]
            layer_rows.append({"key": key, "format": qt.fmt.spec, "family": FAMILIES[tag].name, "tag": tag,
                               "shape": list(qt.shape), "bytes": int(sum(a.nbytes for a in entries.values())), "shard": fname})
        size = write_safetensors(staging / fname, items, SHARD_METADATA)
        shard_rows.append({"file": fname, "bytes": size, "layers": len(keys)})
        if kill_after is not None and int(kill_after) == n:
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: an interrupted save
    write_safetensors(staging / spec.RESIDUAL, sorted(residual.items()))
    model_dir = source.dir
    for name in spec.ASSETS:
        if source.exists(name):
            shutil.copyfile(source.path(name), staging / name)
    for p in sorted(staging.iterdir()):
        files[p.name] = {"bytes": p.stat().st_size, "crc32": crc32_file(p)}
    cfg_bytes = source.path(spec.CONFIG).read_bytes()
    report = {
        "format": "UQFF", "version": ".".join(map(str, spec.VERSION)), "writer": "moqe-toolkit",
        "policy": qreport.policy, "backend": backend,
        "source": {"path": str(model_dir.resolve()), "config_sha256": hashlib.sha256(cfg_bytes).hexdigest()},
        "shards": shard_rows, "residual": {"file": spec.RESIDUAL, "tensors": len(residual)},
        "files": files, "layers": layer_rows, "summary": qreport.summary(), "weights": qreport.rows,
        **mistralrs_report(shard_rows, layer_rows, qreport.policy),
    }
    if host is not None:  # the joint plan's places (toolkit/model/placement.py: bundle_places reads them)
        report["placement"] = {"host": {str(i): [int(e) for e in np.flatnonzero(row)] for i, row in enumerate(host) if row.any()}}
    path = staging / spec.REPORT
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return report
