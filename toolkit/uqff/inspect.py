"""``moqe uqff inspect OUT``: version, layers by format, bytes, read from the headers (no weights loaded)."""
from __future__ import annotations

import numpy as np

from .families import FAMILIES


def inspect_bundle(directory, allow_outside: bool = False) -> dict:
    """Validate the bundle's structure (headers, versions, tags; no CRC pass) and summarise it."""
    from .reader import Bundle

    b = Bundle(directory, verify=False, allow_outside=allow_outside)
    fmt_of = {r.get("key"): r.get("format") for r in b.report.get("layers", []) if isinstance(r, dict)}
    by: dict[tuple, list] = {}
    for key, tag in sorted(b.tags.items()):
        nbytes = b.layer_nbytes(key)
        acc = by.setdefault((str(fmt_of.get(key, "?")), FAMILIES[tag].name, tag), [0, 0])
        acc[0] += 1
        acc[1] += nbytes
    res = b.residual_file
    res_bytes = sum(int(np.prod(res.info(n)[1], dtype=np.int64)) * res.info(n)[0].itemsize for n in res.keys())
    return {
        "directory": str(b.dir), "version": ".".join(map(str, b.version or ())), "policy": b.report.get("policy"),
        "source": b.report.get("source", {}), "shards": [s for s in b.report["_shards"]],
        "formats": [{"format": k[0], "family": k[1], "tag": k[2], "layers": v[0], "bytes": v[1]} for k, v in sorted(by.items())],
        "residual": {"tensors": len(res.keys()), "bytes": res_bytes},
        "file_bytes": sum(size for size, _ in b.report["_files"].values()),
    }
