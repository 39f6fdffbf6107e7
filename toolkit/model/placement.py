"""Where each routed expert lives: on the device or on the host (hybrid inference, issue 33).

On ``cuda`` / ``cuda-emu`` everything lives on the device by default. A placement moves routed experts to the
host, where the Numba kernels run them (``toolkit/model/moe.py``: ``hybrid_experts``); attention, router,
shared experts, norms, embeddings, head and the KV cache stay on the device. Three ways to say it, as llama.cpp
says the first two:

- ``--cpu-moe``: every routed expert on the host;
- ``--n-cpu-moe N``: the routed experts of layers ``0 .. N-1`` on the host (llama.cpp's meaning: layer indices,
  so a leading dense layer counts and has no expert to move);
- ``--placement FILE``: one line per layer or expert, ``layers.I.experts=host`` (the whole layer) or
  ``layers.I.experts.E=host`` (``device`` too, to take one back from a whole-layer line); experts not named stay
  on the device. ``#`` starts a comment.

:class:`PlacementSpec` is what the user said; :func:`resolve_places` turns it into :class:`Places` (a host mask
``[L, E]``) for one model and backend, and refuses what cannot be, before any weight is read: an expert or a
layer the model does not have, a line given twice, and a device placement on a backend without a device.

Shape legend: ``L`` layers, ``E`` routed experts per layer, ``A`` active experts per token, ``D`` hidden.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from ..backend import capabilities
from ..errors import ModelError

HOST, DEVICE = "host", "device"
LINE = re.compile(r"^layers\.(\d+)\.experts(?:\.(\d+))?$")


@dataclass(frozen=True)
class PlacementSpec:
    """The user's placement, before the model is known. ``file`` is read by :func:`resolve`."""

    cpu_moe: bool = False
    n_cpu_moe: int | None = None
    file: str | None = None
    plan: str | None = None  # a plan file with a place column (``moqe plan --vram --ram``): its places

    def __post_init__(self):
        given = [n for n, v in (("--cpu-moe", self.cpu_moe), ("--n-cpu-moe", self.n_cpu_moe is not None),
                                ("--placement", self.file is not None)) if v]
        if len(given) > 1:
            raise ModelError(f"{' and '.join(given)} each say where the experts live; give one")
        if self.n_cpu_moe is not None and self.n_cpu_moe < 0:
            raise ModelError(f"--n-cpu-moe must be >= 0, got {self.n_cpu_moe}")

    @property
    def given(self) -> bool:
        return self.cpu_moe or self.n_cpu_moe is not None or self.file is not None or self.plan is not None

    @property
    def label(self) -> str:
        if self.cpu_moe:
            return "--cpu-moe"
        if self.n_cpu_moe is not None:
            return f"--n-cpu-moe {self.n_cpu_moe}"
        if self.plan:
            return f"--plan {self.plan}"
        return f"--placement {self.file}" if self.file else "all on the device"


@dataclass(frozen=True)
class Places:
    """``host [L, E]`` bool: True where a routed expert lives on the host (rows of dense layers all False)."""

    host: np.ndarray
    label: str

    def layer(self, i: int) -> np.ndarray | None:
        """Layer ``i``'s host mask ``[E]``, or None when all its experts are on the device."""
        m = self.host[i] if 0 <= i < len(self.host) else None
        return m if m is not None and m.any() else None

    @property
    def any_host(self) -> bool:
        return bool(self.host.any())

    def counts(self, moe_layers) -> tuple[int, int]:
        """(experts on the device, experts on the host) over the MoE layers."""
        h = int(self.host[list(moe_layers)].sum()) if len(moe_layers) else 0
        return len(moe_layers) * self.host.shape[1] - h, h


def parse_placement(text: str, cfg, where: str = "placement") -> np.ndarray:
    """Placement file text -> host mask ``[L, E]``. The message of a refusal names the file and line."""
    L, E = cfg.num_layers, cfg.num_experts
    moe = [i for i in range(L) if cfg.moe_layers[i]]
    host = np.zeros((L, E), bool)
    seen: dict[tuple, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, place = (s.strip() for s in line.partition("="))
        m = LINE.match(name)
        if not sep or m is None or place not in (HOST, DEVICE):
            raise ModelError(f"{where}, line {n}: {raw.strip()!r} must look like layers.I.experts=host or "
                             f"layers.I.experts.E=device")
        i, e = int(m.group(1)), None if m.group(2) is None else int(m.group(2))
        if i not in moe:
            raise ModelError(f"{where}, line {n}: the model has no MoE layer {i}"
                             + (f" (MoE layers: {moe[0]}..{moe[-1]})" if moe else ""))
        if e is not None and e >= E:
            raise ModelError(f"{where}, line {n}: the model has {E} experts per layer (0..{E - 1}); no expert {e}")
        if (i, e) in seen:
            raise ModelError(f"{where}, line {n}: {name} is already placed on line {seen[i, e]}")
        seen[i, e] = n
    # whole-layer lines first, then single experts over them (the file's order does not matter)
    for (i, e), n in sorted(seen.items(), key=lambda kv: kv[0][1] is not None):
        line = text.splitlines()[n - 1].split("#", 1)[0]
        on_host = line.partition("=")[2].strip() == HOST
        if e is None:
            host[i, :] = on_host
        else:
            host[i, e] = on_host
    return host


def resolve_places(spec: PlacementSpec | None, cfg, backend: str) -> Places | None:
    """The host mask of ``spec`` for the model ``cfg`` on ``backend`` (None: every expert where the backend
    computes). On a backend without a device every expert is on the host already: a placement that puts any
    on the device is refused (naming the backends that have one); one that puts all on the host changes nothing."""
    if isinstance(spec, Places):  # already a mask (the app's planner): checked against the model
        if spec.host.shape != (cfg.num_layers, cfg.num_experts):
            raise ModelError(f"placement {spec.label}: a host mask of shape {list(spec.host.shape)}; the model has "
                             f"{cfg.num_layers} layers of {cfg.num_experts} experts")
        if not capabilities(backend).on_device:
            raise ModelError(f"placement {spec.label} needs a device; --backend {backend} has none")
        return spec if spec.any_host else None
    if spec is None or not spec.given:
        return None
    L, E = cfg.num_layers, cfg.num_experts
    moe = np.array([bool(cfg.moe_layers[i]) for i in range(L)])
    if spec.plan is not None:
        from ..files import read_text
        from ..quant.plan import plan_places

        planned = plan_places(read_text(spec.plan, "plan file"), cfg, str(spec.plan))
        other = dataclasses.replace(spec, plan=None)
        if planned is None:  # a plan of formats only: the other flags say where
            return resolve_places(other, cfg, backend)
        if other.given:
            raise ModelError(f"--plan {spec.plan} places every expert (its place column); drop {other.label}")
    if spec.cpu_moe:
        host = np.repeat(moe[:, None], E, 1)
    elif spec.n_cpu_moe is not None:
        host = np.zeros((L, E), bool)
        host[:spec.n_cpu_moe] = True
        host &= moe[:, None]
    elif spec.plan is not None:
        host = planned
    else:
        from ..files import read_text

        host = parse_placement(read_text(spec.file, "placement file"), cfg, str(spec.file))
    places = Places(host, spec.label)
    if not capabilities(backend).on_device:
        if spec.plan is not None:
            return None  # a plan's places are for a device; on the CPU its formats apply, every expert on the host
        dev, _ = places.counts([i for i in range(L) if moe[i]])
        if dev:
            raise ModelError(f"{spec.label} places {dev} routed expert(s) on the device, and --backend {backend} has "
                             f"none (every expert already runs on the host); use --backend cuda (a GPU) or cuda-emu")
        return None
    return places if places.any_host else None


def layer_bus_bytes(tokens: int, host_rows: int, hidden: int, top_k: int) -> dict:
    """What one layer with host experts copies per call (``hybrid_experts``): out, the routing of every token
    (ids and weights, ``tokens x A x 4`` bytes each) and the hidden rows of the ``host_rows`` tokens routed to a
    host expert (``x D x 4``); in, those rows' indices (``x 4``) and the host's output rows (``x D x 4``). No
    weight byte crosses after load."""
    out = tokens * top_k * 4 * 2 + host_rows * hidden * 4
    inn = host_rows * 4 + host_rows * hidden * 4 if host_rows else 0
    return {"out": out, "in": inn}


def where_bytes(cfg, places: Places, fmt: str | None) -> dict:
    """Where a model's bytes live under ``places``, from its config alone (``moqe info``): everything but the routed
    experts on the device (f32, as the CUDA kernels read dense weights), routed experts on the
    device (stored layout of ``fmt``; None: f32) and on the host (the Numba kernels' packed
    layout), and the bytes one decode token moves across the bus: at most (every MoE layer with host experts
    sees the token routed to one of them) and expected under uniform routing (a layer with ``h`` of ``E`` experts on
    the host: ``1 - C(E-h, A) / C(E, A)`` of the tokens)."""
    from math import comb

    from ..formats import get_format
    from .inspect import packed_bytes, parameter_count

    D, I, E, A = cfg.hidden_size, cfg.expert_intermediate, cfg.num_experts, cfg.top_k
    f = get_format(fmt or "f32")  # unquantized experts run f32 on both sides (hybrid_experts: f32 QTensors)
    dev_one = f.nbytes((2 * I, D)) + f.nbytes((D, I))  # one expert's gate_up + down as uploaded
    host_one = packed_bytes(f, 2 * I, D) + packed_bytes(f, D, I)  # as the Numba kernels hold them
    moe = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    n_dev, n_host = places.counts(moe)
    most = expected = 0.0
    for i in moe:
        h = int(places.host[i].sum())
        if h:
            per = layer_bus_bytes(1, 1, D, A)
            one = per["out"] + per["in"]
            most += one
            touched = 1 - comb(E - h, A) / comb(E, A)
            expected += touched * (per["out"] + per["in"] - 2 * A * 4) + 2 * A * 4  # routing crosses for every token
    counts = parameter_count(cfg)
    rest = 4 * (counts["attention"] + counts["other"])  # the CUDA kernels read dense weights in f32
    return {"format": f.spec, "rest on the device (f32)": rest, "experts on the device": n_dev, "device bytes": n_dev * dev_one,
            "experts on the host": n_host, "host bytes": n_host * host_one,
            "bus bytes per token (at most)": int(most), "bus bytes per token (uniform routing)": int(round(expected))}


def bundle_places(report: dict, cfg, where: str) -> Places | None:
    """The places a bundle's report saved (``"placement": {"host": {"LAYER": [experts]}}``, from a joint plan), or
    None; a malformed entry is refused naming the report."""
    entry = report.get("placement")
    if entry is None:
        return None
    host = np.zeros((cfg.num_layers, cfg.num_experts), bool)
    rows = entry.get("host") if isinstance(entry, dict) else None
    if not isinstance(rows, dict):
        raise ModelError(f"{where}: 'placement' must be an object with 'host': {{layer: [experts]}}")
    for k, experts in rows.items():
        if not str(k).isdigit() or int(k) >= cfg.num_layers or not cfg.moe_layers[int(k)]:
            raise ModelError(f"{where}: placement names layer {k!r}, not a MoE layer of the model")
        if not isinstance(experts, list) or not all(isinstance(e, int) and 0 <= e < cfg.num_experts for e in experts):
            raise ModelError(f"{where}: placement of layer {k}: a list of expert ids in 0..{cfg.num_experts - 1}")
        host[int(k), experts] = True
    return Places(host, "the bundle's placement") if host.any() else None
