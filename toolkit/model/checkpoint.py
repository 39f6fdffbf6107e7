"""A Hugging Face checkpoint directory: ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; tensors read lazily (memory-mapped) by name."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..files import Folder, check_name
from ..mapped import release
from .safetensors_io import SafeTensorsFile
from .schema import Keys

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


class Checkpoint:
    """Tensors of a checkpoint folder by name. Every file it opens lies inside the folder (see
    :mod:`toolkit.files`; ``allow_outside`` lifts that) and is a regular file."""

    def __init__(self, directory: str | Path, allow_outside: bool = False):
        self.folder = Folder(directory, allow_outside)
        self.dir = self.folder.dir
        index = "model.safetensors.index.json"
        self._where: dict[str, SafeTensorsFile] = {}
        self.index = self.dir / index if self.folder.exists(index) else None
        if self.index is not None:
            where = self.dir / index
            weight_map = Keys(self.folder.json(index), str(where)).obj("weight_map").raw
            if not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
                raise ModelError(f"{where}: 'weight_map' must map tensor names to shard file names")
            files = {}
            for name, shard in weight_map.items():
                if shard not in files:
                    check_name(shard, str(where))
                    if not self.folder.exists(shard):
                        raise ModelError(f"{where}: shard {shard!r} (holding {name!r}) is missing")
                    files[shard] = SafeTensorsFile(self.folder.path(shard, where=str(where), what="shard"))
                if name not in files[shard]:
                    raise ModelError(f"{self.dir / shard}: the index lists {name!r} here, but the shard lacks it")
                self._where[name] = files[shard]
        else:
            shards = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not shards:
                raise ModelError(f"{self.dir}: no *.safetensors files and no model.safetensors.index.json")
            for shard in shards:
                f = SafeTensorsFile(self.folder.path(shard, what="safetensors file"))
                for name in f.keys():
                    if name in self._where:
                        raise ModelError(f"{self.dir}: tensor {name!r} is in both {self._where[name].path.name} and {shard}")
                    self._where[name] = f

    def layer_count(self) -> int:
        """1 + the highest ``model.layers.N`` index among the tensor names (0 when there is none)."""
        ids = [int(m.group(1)) for m in map(_LAYER_RE.match, self._where) if m]
        return max(ids) + 1 if ids else 0

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def missing(self, name: str) -> str:
        """The message for a tensor the checkpoint lacks (naming the index when one decides what is read)."""
        if self.index is not None:
            return f"{self.index}: lists no tensor {name!r}"
        return f"{self.dir}: checkpoint has no tensor {name!r}"

    def where(self, name: str) -> str:
        """The file holding ``name`` (or the folder, when no file does)."""
        f = self._where.get(name)
        return str(f.path) if f is not None else str(self.dir)

    def get(self, name: str) -> np.ndarray:
        """Memory-mapped view in the stored dtype."""
        if name not in self._where:
            raise ModelError(self.missing(name))
        return self._where[name].get(name)

    def get_f32(self, name: str) -> np.ndarray:
        """The tensor converted to float32, checked for NaN/inf (names the tensor when bad). A converted copy's
        mapped source pages are handed back at once (``toolkit.mapped``): the copy is what is kept."""
        src = self.get(name)
        a = np.asarray(src, dtype=np.float32)
        if a is not src and not np.may_share_memory(a, src):
            release([src])
        if not np.isfinite(a).all():
            bad = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
            raise ModelError(f"{self.dir}: tensor {name!r} holds NaN or inf (first at {bad})")
        return a
