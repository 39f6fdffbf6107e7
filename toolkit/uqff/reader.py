"""Open, validate and load a UQFF bundle (memory-mapped, no requantization).

:class:`Bundle` checks everything before a weight is used: the report (manifest) and the files it lists
(sizes, CRC-32 when ``verify``), every shard's safetensors header and version tensors, format tags,
duplicate keys across shards, entry dtypes and byte lengths, and that every stored tensor is used by the
config. Each failure is a :class:`~toolkit.uqff.spec.UQFFError` naming the file and the tensor.
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from ..backend import capabilities, resolve_backend
from ..errors import ModelError, ToolkitError
from ..files import Folder, check_name, json_type
from ..formats import QTensor, get_format
from ..formats.mixed import group_experts
from ..mapped import release
from ..model import MoEModel, Tokenizer, load_config, load_weights
from ..model.placement import bundle_places, resolve_places
from ..model.safetensors_io import SafeTensorsFile
from . import spec
from .families import FAMILIES, Entries
from ..model.shard import take_experts
from .keys import expert_keys, join_rows, layer_keys

F32 = get_format("f32")
from .spec import UQFFError, crc32_file


def is_bundle(directory) -> bool:
    d = Path(directory)
    return d.is_dir() and ((d / spec.REPORT).exists() or any(d.glob("*" + spec.SHARD_SUFFIX)))


def _open(path: Path) -> SafeTensorsFile:
    try:
        return SafeTensorsFile(path)
    except ToolkitError as e:
        raise UQFFError(str(e)) from None
    except Exception as e:  # a header mutated into something the JSON/int conversions reject differently
        raise UQFFError(f"{path}: malformed safetensors header ({type(e).__name__}: {e})") from None


def read_report(directory: Path, folder: Folder | None = None) -> dict:
    folder = folder or Folder(directory)
    path = directory / spec.REPORT
    if not folder.exists(spec.REPORT):
        raise UQFFError(f"{directory}: not a complete UQFF bundle (no {spec.REPORT}; an interrupted save or not a bundle)")
    try:
        report = folder.json(spec.REPORT)
    except ModelError as e:
        raise UQFFError(str(e)) from None
    if "outputs" in report and not any(k in report for k in OUR_REPORT_KEYS):  # mistral.rs's report (schema 1);
        return _mistralrs_report(report, path)  # ours carries its fields too, and is always read strictly
    try:
        shards = _list(report, "shards")
        shard_files = [_str(_obj(s, f"shards[{i}]").get("file"), f"shards[{i}].file") for i, s in enumerate(shards)]
        files = {}
        for name, entry in _obj(report.get("files"), "files").items():
            e = _obj(entry, f"files.{name}")
            files[name] = (_int(e.get("bytes"), f"files.{name}.bytes"), _int(e.get("crc32"), f"files.{name}.crc32"))
        table = {}
        for i, row in enumerate(_list(report, "layers")):
            r, where = _obj(row, f"layers[{i}]"), f"layers[{i}]"
            key = _str(r.get("key"), f"{where}.key")
            if key in table:
                raise ValueError(f"layer {key!r} is listed twice in 'layers'")
            table[key] = (_str(r.get("shard"), f"{where}.shard"), _int(r.get("tag"), f"{where}.tag"),
                          tuple(_int(d, f"{where}.shape") for d in _list(r, "shape", where)),
                          _int(r.get("bytes"), f"{where}.bytes"), _str(r.get("format"), f"{where}.format"))
    except ValueError as e:
        raise UQFFError(f"{path}: malformed report ({e})") from None
    report["_shards"], report["_files"], report["_layers"] = shard_files, files, table
    return report


OUR_REPORT_KEYS = ("format", "version", "writer", "shards", "files", "layers")  # none of them in mistral.rs's


def _mistralrs_report(report: dict, path: Path) -> dict:
    """mistral.rs's ``uqff_report.json`` (``schema``, ``generated_by``, ``uqff_version``, ``outputs[{quant,
    shards, layer_details[{module, stored, shape}]}]``): shards from every output; no file sizes or CRCs to check,
    no per-layer tags (the shards' ``.weight.format`` entries say them)."""
    try:
        if report.get("schema") != 1:
            raise ValueError(f"'schema' is {report.get('schema')!r}; this reader knows mistral.rs's schema 1")
        shards, table = [], {}
        for i, out in enumerate(_list(report, "outputs")):
            o = _obj(out, f"outputs[{i}]")
            shards += [_str(s, f"outputs[{i}].shards") for s in _list(o, "shards", f"outputs[{i}]")]
            for j, row in enumerate(o.get("layer_details") or []):
                r, where = _obj(row, f"outputs[{i}].layer_details[{j}]"), f"outputs[{i}].layer_details[{j}]"
                table[_str(r.get("module"), f"{where}.module")] = tuple(_int(d, f"{where}.shape") for d in _list(r, "shape", where))
    except ValueError as e:
        raise UQFFError(f"{path}: malformed mistral.rs report ({e})") from None
    report["_shards"], report["_files"], report["_layers"] = shards, None, None
    report["_mistralrs"] = table
    return report


def _obj(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"{where!r} must be an object, found {json_type(v)}" if v is not None else f"{where!r} is missing")
    return v


def _list(parent: dict, key: str, where: str = "") -> list:
    v, name = parent.get(key), f"{where}.{key}" if where else key
    if not isinstance(v, list):
        raise ValueError(f"{name!r} must be a list, found {json_type(v)}" if v is not None else f"{name!r} is missing")
    return v


def _str(v, where: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{where!r} must be a string, found {json_type(v)}" if v is not None else f"{where!r} is missing")
    return v


def _int(v, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where!r} must be a non-negative integer, found {v!r}" if v is not None else f"{where!r} is missing")
    return v


class Bundle:
    """A validated bundle: ``layer(key) -> QTensor`` and ``residual(name) -> f32`` as memory-mapped views.
    Every file it opens is a regular file inside the bundle folder (``allow_outside`` lets symlinks leave)."""

    def __init__(self, directory, verify: bool = True, allow_outside: bool = False):
        self.dir = Path(directory)
        try:
            self.folder = Folder(self.dir, allow_outside)
        except ModelError as e:
            raise UQFFError(str(e)) from None
        self.report = report = read_report(self.dir, self.folder)
        self._check_files(report, verify)
        self.version = None
        self._where: dict[str, SafeTensorsFile] = {}
        self.tags: dict[str, int] = {}
        for fname in report["_shards"]:  # opened through the folder's read rule, whatever the report's schema
            self._index_shard(_open(self._inside(fname)))
        self.residual_file = _open(self._inside(spec.RESIDUAL))
        self._check_entries()
        self._check_layer_table(report["_layers"])
        self.used: set[str] = set()

    def _inside(self, name: str) -> Path:
        """A file of the bundle, resolved by :meth:`toolkit.files.Folder.path` (inside after symlinks, regular)."""
        try:
            return self.folder.path(name, where=str(self.dir / spec.REPORT))
        except ModelError as e:
            raise UQFFError(str(e)) from None

    # ---- validation ----------------------------------------------------------------------------------
    def _check_files(self, report: dict, verify: bool) -> None:
        files = report["_files"]
        if files is None:  # mistral.rs's report lists no sizes or CRCs: the files must exist, that is all
            files = {}
            for need in (spec.RESIDUAL, *spec.REQUIRED_ASSETS, *report["_shards"]):
                if not self.folder.exists(need):
                    raise UQFFError(f"{self.dir / need}: missing (a mistral.rs bundle needs it)")
        for need in (spec.RESIDUAL, *spec.REQUIRED_ASSETS, *report["_shards"]) if report["_files"] is not None else ():
            if need not in files:
                raise UQFFError(f"{self.dir / spec.REPORT}: does not list {need}")
        for s in report["_shards"]:
            try:
                check_name(s, str(self.dir / spec.REPORT))
            except ModelError as e:
                raise UQFFError(str(e)) from None
            if not spec.SHARD_RE.match(s) or "/" in s:
                raise UQFFError(f"{self.dir / spec.REPORT}: shard name {s!r} is not a plain <stem>-<n>{spec.SHARD_SUFFIX} file name")
        if len(set(report["_shards"])) != len(report["_shards"]):
            raise UQFFError(f"{self.dir / spec.REPORT}: the shard list names a shard twice: {report['_shards']}")
        stray = sorted(p.name for p in self.dir.glob("*" + spec.SHARD_SUFFIX) if p.name not in report["_shards"])
        if stray:
            raise UQFFError(f"{self.dir}: shard(s) {', '.join(stray)} are not listed in {spec.REPORT}")
        for name, (size, crc) in files.items():
            try:
                check_name(name, str(self.dir / spec.REPORT))
            except ModelError as e:
                raise UQFFError(str(e)) from None
            if "/" in name:
                raise UQFFError(f"{self.dir / spec.REPORT}: file name {name!r} is not a plain file name of the bundle")
            if not self.folder.exists(name):
                raise UQFFError(f"{self.dir / name}: missing (listed in {spec.REPORT})")
            try:
                p = self.folder.path(name, where=str(self.dir / spec.REPORT))
            except ModelError as e:
                raise UQFFError(str(e)) from None
            actual = p.stat().st_size
            if actual != size:
                raise UQFFError(f"{p}: {actual} bytes, the report says {size} ({'truncated' if actual < size else 'grown'})")
            if verify and crc32_file(p) != crc:
                raise UQFFError(f"{p}: CRC-32 mismatch (the file changed after it was written)")

    def _index_shard(self, f: SafeTensorsFile) -> None:
        version = []
        for k in spec.VERSION_KEYS:
            if k not in f:
                raise UQFFError(f"{f.path}: no {k} tensor (not a UQFF shard, or written before versioning)")
            dtype, shape = f.info(k)
            if dtype != np.dtype(np.uint32) or shape != ():
                raise UQFFError(f"{f.path}: tensor {k!r} is {dtype}{list(shape)}, expected a U32 scalar")
            version.append(int(f.get(k)))
        major, minor, _ = version
        if major != spec.VERSION[0] or minor > spec.VERSION[1]:
            raise UQFFError(f"{f.path}: UQFF version {'.'.join(map(str, version))} is not readable by this toolkit "
                            f"(reads {spec.VERSION[0]}.0 .. {spec.VERSION[0]}.{spec.VERSION[1]}.x)")
        self.version = tuple(version)
        for name in f.keys():
            if name in spec.VERSION_KEYS:
                continue
            if name in self._where:
                raise UQFFError(f"{self.dir}: tensor {name!r} is in both {self._where[name].path.name} and {f.path.name}")
            self._where[name] = f
            if name.endswith(spec.FORMAT_SUFFIX):
                dtype, shape = f.info(name)
                if dtype != np.dtype(np.uint8) or shape != ():
                    raise UQFFError(f"{f.path}: tensor {name!r} is {dtype}{list(shape)}, expected a U8 scalar")
                tag = int(f.get(name))
                if tag not in FAMILIES:
                    known = ", ".join(f"{t}={n.name}" for t, n in FAMILIES.items())
                    other = f" (mistral.rs family {spec.MISTRALRS_TAGS[tag]}, not read by this toolkit)" \
                        if tag in spec.MISTRALRS_TAGS else ""
                    raise UQFFError(f"{f.path}: tensor {name!r}: unknown format tag {tag}{other}; known: {known}")
                self.tags[name[: -len(spec.FORMAT_SUFFIX)]] = tag

    def _check_entries(self) -> None:
        allowed = {k + s for k, t in self.tags.items() for s in (spec.FORMAT_SUFFIX, *FAMILIES[t].suffixes)}
        for name, f in self._where.items():
            if name not in allowed:
                raise UQFFError(f"{f.path}: tensor {name!r} belongs to no layer (no matching {spec.FORMAT_SUFFIX})")

    def _check_layer_table(self, table: dict | None) -> None:
        """Each shard holds exactly the layers the report's table assigns to it, with their tags (shapes are
        compared when a layer is decoded, after its family has checked its entries' bytes against them).
        A mistral.rs report: each layer it details is in a shard with the shape it gives."""
        where = self.dir / spec.REPORT
        if table is None:
            for key, shape in self.report["_mistralrs"].items():
                if key not in self.tags:
                    raise UQFFError(f"{self.dir}: layer {key!r} (listed in {where}) is missing from every shard")
            self._table = None
            return
        for key in sorted(set(table) | set(self.tags)):
            if key not in table:
                raise UQFFError(f"{self._where[key + spec.FORMAT_SUFFIX].path}: layer {key!r} is not in the layer table of {where}")
            shard, tag = table[key][:2]
            if key not in self.tags:
                raise UQFFError(f"{self.dir / shard}: layer {key!r} (listed in {where}) is missing from every shard")
            f = self._where[key + spec.FORMAT_SUFFIX]
            if f.path.name != shard:
                raise UQFFError(f"{f.path}: holds layer {key!r}, which the report's layer table places in {shard}")
            if self.tags[key] != tag:
                raise UQFFError(f"{f.path}: layer {key!r} has format tag {self.tags[key]}, the report's layer table says {tag}")
        self._table = table

    def _lookup(self, name: str) -> tuple[np.ndarray, str]:
        f = self._where.get(name)
        if f is None:
            raise UQFFError(f"{self.dir}: tensor {name!r} is missing from every shard")
        return f.get(name), str(f.path)

    # ---- access --------------------------------------------------------------------------------------
    def layer(self, key: str):
        self.used.add(key)
        qt = FAMILIES[self.tags[key]].decode(Entries(key, self._lookup))
        if self._table is None:  # mistral.rs: the shape its report details, when it details the layer
            want = self.report["_mistralrs"].get(key)
            if want is not None and tuple(qt.shape) != tuple(want):
                raise UQFFError(f"{self._where[key + spec.FORMAT_SUFFIX].path}: layer {key!r} has shape {list(qt.shape)}, "
                                f"{self.dir / spec.REPORT} says {list(want)}")
            return qt
        _, _, shape, nbytes, fmt = self._table[key]
        found = (list(qt.shape), qt.fmt.spec, self.layer_nbytes(key))
        if found != (list(shape), fmt, nbytes):
            raise UQFFError(f"{self._where[key + spec.FORMAT_SUFFIX].path}: layer {key!r} is {qt.fmt.spec}{list(qt.shape)} "
                            f"in {found[2]} bytes, the report's layer table says {fmt}{list(shape)} in {nbytes} bytes")
        return qt

    def residual(self, name: str) -> np.ndarray:
        f = self.residual_file
        if name not in f:
            raise UQFFError(f"{f.path}: no tensor {name!r}")
        a = f.get(name)
        if a.dtype.kind != "f" and a.dtype != np.dtype(ml_dtypes.bfloat16):
            raise UQFFError(f"{f.path}: tensor {name!r} is {a.dtype}, expected a float type")
        self.used.add(name)
        out = np.asarray(a, dtype=np.float32)
        if not np.may_share_memory(out, a):  # a widened copy is kept: the mapped 16-bit pages are handed back
            release([np.asarray(a)])
        if not np.isfinite(out).all():
            idx = tuple(int(i) for i in np.argwhere(~np.isfinite(out))[0])
            raise UQFFError(f"{f.path}: tensor {name!r} holds NaN or inf (first at {idx})")
        return out

    def layer_nbytes(self, key: str) -> int:
        """Bytes of one layer's entries, from the headers (nothing read)."""
        total = 0
        for s in (spec.FORMAT_SUFFIX, *FAMILIES[self.tags[key]].suffixes):
            f = self._where.get(key + s)
            if f is not None:
                dtype, shape = f.info(key + s)
                total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return total

    def unused(self) -> list[str]:
        return sorted((set(self.tags) | set(self.residual_file.keys())) - self.used)


class _ResidualCheckpoint:
    """What ``load_weights`` asks of a checkpoint, answered from ``residual.safetensors``."""

    def __init__(self, bundle: Bundle):
        self.b, self.dir = bundle, bundle.dir / spec.RESIDUAL  # errors name the residual file

    def missing(self, name: str) -> str:
        return f"{self.dir}: holds no tensor {name!r}"

    def __contains__(self, name: str) -> bool:
        return name in self.b.residual_file or self._layer_key(name) is not None

    def keys(self):
        return self.b.residual_file.keys()

    def _layer_key(self, name: str) -> str | None:
        key = name[: -len(".weight")] if name.endswith(".weight") else None
        return key if key is not None and key in self.b.tags else None

    def get_f32(self, name: str) -> np.ndarray:
        """From the residual file, or (mistral.rs puts embeddings and the LM head in the shards) a shard layer
        read in f32."""
        key = None if name in self.b.residual_file else self._layer_key(name)
        if key is None:
            return self.b.residual(name)
        w = self.b.layer(key)
        return w.dequantize("numpy") if isinstance(w, QTensor) else np.asarray(w, np.float32)

    get = get_f32

    def stored(self, name: str) -> np.ndarray | None:
        """A residual tensor as stored (a view of the mapped file), or None when the shards hold it."""
        f = self.b.residual_file
        if name not in f:
            return None
        self.b.used.add(name)
        return f.get(name)


def bundle_transform(bundle: Bundle):
    """A ``load_weights`` transform that takes each weight from the bundle (never calling the loader)."""

    def _stored(key: str) -> bool:
        return key in bundle.tags or key + ".weight" in bundle.residual_file

    def _expert(keys, e: int, role: str, name: str) -> QTensor:
        """Expert ``e`` of a weight stored one expert at a time: its quantized layers, or its full-precision
        residual tensors (an f32 QTensor)."""
        parts = []
        for k in expert_keys(keys, e):
            if k in bundle.tags:
                parts.append(bundle.layer(k))
            elif k + ".weight" in bundle.residual_file:
                parts.append(F32.quantize(bundle.residual(k + ".weight"), "numpy", name=k))
            else:
                raise UQFFError(f"{bundle.dir}: expert {e} of {name!r} ({role}) is missing: no layer {k} in the shards "
                                f"and no {k}.weight in {spec.RESIDUAL} (the bundle stores this weight one expert at a time)")
        return join_rows(parts)

    def transform(role, name, load, shape, layer=None):
        stored = getattr(load, "qtensor", None)  # a table or projection the runtime keeps as the residual stores it
        if (role in ("embed", "lm_head") or role.startswith("attn.")) and stored is not None and stored() is not None:
            return stored()
        if role == "lm_head" and name == "model.embed_tokens.weight":  # tied: the table already loaded
            return load()
        keys, names = layer_keys(role, name)
        ids = getattr(load, "experts", (None,))[0]  # a shard's experts (expert parallelism): global ids, else all
        cut = (lambda w: w) if ids is None else (lambda w: take_experts(w, ids))
        experts = range(shape[0]) if ids is None else [int(e) for e in ids]
        if all(k in bundle.tags for k in keys):
            out = join_rows([cut(bundle.layer(k)) for k in keys])
        elif len(shape) == 3 and any(_stored(k) for e in experts for k in expert_keys(keys, e)):  # mixed widths
            out = group_experts([_expert(keys, e, role, name) for e in experts])
        elif all(n in bundle.residual_file for n in names):
            out = join_rows([cut(bundle.residual(n)) for n in names])
        else:
            raise UQFFError(f"{bundle.dir}: weight {name!r} ({role}) is missing: no layer {' + '.join(keys)} in the "
                            f"shards and no {' + '.join(names)} in {spec.RESIDUAL}")
        if tuple(out.shape) != tuple(shape):
            raise UQFFError(f"{bundle.dir}: {' + '.join(keys)} has shape {list(out.shape)}, the config implies {list(shape)}")
        if role == "embed" and isinstance(out, QTensor) and out.fmt.quantized:  # rows are looked up, not multiplied:
            out = out.dequantize("numpy")  # a quantized table (mistral.rs's q8_0 embeddings) is read in f32
        return out

    return transform


def load_bundle(directory, backend: str = "numba", kv_cache=None, verify: bool = True, report=None, policy=None,
                allow_outside: bool = False, activations=None, placement=None, shard=None, experts=None):
    """Load a bundle -> (MoEModel, Tokenizer). ``policy``, when given, must be the one the bundle was written with;
    ``report`` (a QuantReport) receives the bundle's per-weight rows; ``placement`` (a PlacementSpec): where the
    routed experts live (``toolkit/model/placement.py``); ``shard`` / ``experts``: an expert-parallel driver's
    share and its remote experts (``toolkit/dist``)."""
    cfg, weights, places, bundle = bundle_weights(directory, backend, verify, report, policy, allow_outside,
                                                  activations, placement, shard)
    try:
        tok = Tokenizer(bundle.dir, cfg.bos_token_id, cfg.eos_token_ids, allow_outside)
    except UQFFError:
        raise
    except ToolkitError as e:
        raise UQFFError(str(e)) from None
    return MoEModel(cfg, weights, backend, experts=experts, kv_cache=kv_cache, activations=activations,
                    places=places), tok


def bundle_weights(directory, backend: str = "numba", verify: bool = True, report=None, policy=None,
                   allow_outside: bool = False, activations=None, placement=None, shard=None):
    """A bundle's (ModelConfig, ModelWeights, Places, Bundle); ``shard`` (an ExpertShard): read only its share
    (the check that every stored tensor is used then skipped)."""
    backend = resolve_backend(backend)
    bundle = Bundle(directory, verify, allow_outside)
    label = str(bundle.report.get("policy", "?"))
    if policy is not None and policy.label not in ("none", label):
        raise UQFFError(f"{bundle.dir}: the bundle was quantized with policy {label!r}, not {policy.label!r} "
                        f"(a bundle is never requantized; drop the policy options or quantize again)")
    try:
        cfg = load_config(bundle.dir, allow_outside)
    except ToolkitError as e:  # the message names the file already
        raise UQFFError(str(e)) from None
    places = resolve_places(placement, cfg, backend)  # refused before any weight is read
    if places is None and (placement is None or not getattr(placement, "given", True)) and capabilities(backend).on_device:
        try:  # a joint plan's places saved with the bundle: the default on a device
            places = bundle_places(bundle.report, cfg, str(bundle.dir / spec.REPORT))
        except ToolkitError as e:
            raise UQFFError(str(e)) from None
    try:
        from ..model.runtime import Runtime

        weights = load_weights(_ResidualCheckpoint(bundle), cfg,
                               transform=Runtime(backend, activations, places).placing(bundle_transform(bundle), cfg, shard))
    except UQFFError:
        raise
    except ToolkitError as e:
        raise UQFFError(str(e) if str(e).startswith(str(bundle.dir)) else f"{bundle.dir}: {e}") from None
    extra = bundle.unused() if shard is None else []
    if extra:
        raise UQFFError(f"{bundle.dir}: {len(extra)} stored tensor(s) are not used by {spec.CONFIG} "
                        f"(e.g. {extra[0]!r}); the config does not match the weights")
    if report is not None:
        report.policy = label
        report.rows.extend(r for r in bundle.report.get("weights", []) if isinstance(r, dict))
    return cfg, weights, places, bundle
