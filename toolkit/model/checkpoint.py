"""A Hugging Face checkpoint directory: ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; tensors read lazily (memory-mapped) by name."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import ModelError
from .safetensors_io import SafeTensorsFile


class Checkpoint:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ModelError(f"{self.dir}: not a model directory")
        index = self.dir / "model.safetensors.index.json"
        self._where: dict[str, SafeTensorsFile] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelError(f"{index}: malformed index ({e})") from None
            files = {}
            for name, shard in weight_map.items():
                if shard not in files:
                    if not (self.dir / shard).exists():
                        raise ModelError(f"{index}: shard {shard!r} (holding {name!r}) is missing")
                    files[shard] = SafeTensorsFile(self.dir / shard)
                if name not in files[shard]:
                    raise ModelError(f"{self.dir / shard}: the index lists {name!r} here, but the shard lacks it")
                self._where[name] = files[shard]
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise ModelError(f"{self.dir}: no *.safetensors files and no model.safetensors.index.json")
            for shard in shards:
                f = SafeTensorsFile(shard)
                for name in f.keys():
                    if name in self._where:
                        raise ModelError(f"{self.dir}: tensor {name!r} is in both {self._where[name].path.name} and {shard.name}")
                    self._where[name] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        """Memory-mapped view in the stored dtype."""
        if name not in self._where:
            raise ModelError(f"{self.dir}: checkpoint has no tensor {name!r}")
        return self._where[name].get(name)

    def get_f32(self, name: str) -> np.ndarray:
        """The tensor converted to float32, checked for NaN/inf (names the tensor when bad)."""
        a = np.asarray(self.get(name), dtype=np.float32)
        if not np.isfinite(a).all():
            bad = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
            raise ModelError(f"{self.dir}: tensor {name!r} holds NaN or inf (first at {bad})")
        return a
