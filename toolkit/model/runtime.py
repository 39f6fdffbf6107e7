"""Where a model's arrays live and the glue between its stages, for one backend, chosen once at the edge.

:class:`Runtime` resolves every op of ``toolkit.ops`` once, places arrays (``weight``, ``qweight``: on the
device for ``cuda`` / ``cuda-emu``, uploaded once at load; NumPy otherwise), and offers the few operations
between the stages: ``linear`` (the f32 GEMV or BLAS on the CPU, cuBLAS through ``Device.gemm`` on a GPU),
``add``, ``gated_add``, ``gather_rows``, ``embedding``: ops of ``toolkit.ops`` like every other, reached through
``op`` (on the CPU NumPy one-liners, ``toolkit/cpu/<op>.py``; on a device kernels of ``cuda_src/`` with that
name), each checked against its NumPy reference in ``toolkit/ref/``.
"""
from __future__ import annotations

import numpy as np

from ..backend import capabilities
from ..cpu import api as cpu
from ..formats import QTensor, get_format
from ..formats.base import readonly
from ..gpu import api as gpu
from ..ops import get_op
from .shard import EXPERT_ROLES, subset_load


STORED_ROWS = 1024  # rows per step of Runtime.stored_precision
# smallest weight (elements) Runtime.dense holds 16-bit: a real model's projections (Mixtral's o: 16.8 M, Qwen3-30B's
# 8.4 M). Smaller ones (the bundled model's: 65 K) stay f32: their bytes do not matter, and a 16-bit build of the
# compiled decode step would be one more to compile per (format, cache) for checkpoints of each width.
DENSE16_MIN = 1 << 20
# hidden size from which the NumPy backend keeps the LM head 16-bit too (numba always does: its 16-bit GEMV);
# below it the reference qlinear's per-call dequantize costs more than the bytes save
HEAD16_MIN_HIDDEN = 1024
TABLES = ("embed", "lm_head")  # the roles keeps16 speaks of
# the roles of a layer's routed experts: kept on the host as loaded where the layer has host experts (placement)
HOST_ROLES = EXPERT_ROLES  # model/shard.py


def format16(torch_dtype) -> str | None:
    """A checkpoint dtype's 16-bit format name ('f16' / 'bf16'), or None (f32 and others)."""
    return {"float16": "f16", "bfloat16": "bf16"}.get(str(torch_dtype).replace("torch.", ""))


class Runtime:
    """``activations``: the expert GEMMs' activation kind on numba ('int8' / 'f32'; None: the default, int8),
    chosen here, where the layers are built: each quantized weight is prepared for it as it is placed.

    ``places`` (:class:`toolkit.model.placement.Places`, or None): on a device, the routed experts that live on the
    host; they are kept there as they load (never uploaded) and run by ``host``, a numba Runtime with
    ``activations`` (``toolkit/model/moe.py``: ``hybrid_experts``)."""

    def __init__(self, backend: str, activations: str | None = None, places=None):
        self.name = backend
        self.caps = capabilities(backend)  # what this backend does beyond the ops (toolkit/backend.py)
        self.on_device = self.caps.on_device
        self.activations = None
        self.places = places if self.on_device else None
        self.host_rt = Runtime("numba", activations) if self.places is not None else None  # the host experts' runtime
        if self.caps.prepares_weights:
            self.activations = cpu.check_activations(activations)
        elif activations not in (None, "f32") and self.host_rt is None:
            from ..errors import BackendError

            raise BackendError(f"--activations {activations} is a numba backend path (got --backend {backend} with "
                               "every expert on the device)")
        if self.on_device:
            self.ops = gpu.ops_for(backend)
            self.device = self.ops.dev
        else:
            self.ops = self.device = None
        self._op = {}

    def op(self, name: str):
        if name not in self._op:
            self._op[name] = get_op(name, self.name)
        return self._op[name]

    # ---- placement ---------------------------------------------------------------------------------------
    def host_experts(self, layer) -> np.ndarray | None:
        """Layer ``layer``'s host mask ``[E]`` (True: that routed expert lives on the host), or None: all where
        this backend computes."""
        return self.places.layer(layer) if self.places is not None and layer is not None else None

    def is_device_array(self, a) -> bool:
        return self.on_device and not isinstance(a, np.ndarray)

    def weight(self, a, dtype=np.float32):
        """A weight as the kernels read it: contiguous ``dtype``; read-only on the CPU, uploaded once on a device."""
        if a is None:
            return None
        if self.is_device_array(a):
            return a
        a = np.ascontiguousarray(a, dtype=dtype)
        return self.device.to_device(a) if self.on_device else readonly(a)

    def qweight(self, qt: QTensor, role: str | None = None) -> QTensor:
        if self.caps.prepares_weights:  # on this runtime's activations unless the load prepared it (packed at first call)
            if cpu.prepared_kind(qt) is None:
                cpu.mark_activations(qt, self.activations)
            return qt
        if not self.on_device or all(self.is_device_array(a) for a in qt.arrays.values()):
            return qt
        return gpu.upload_qtensor(self.device, qt, role)

    def place(self, obj, role: str | None = None):
        """A loaded weight (ndarray or QTensor) where the backend computes: the upload at load time (``role``:
        the weight's role in the layer, e.g. 'moe.gate_up', which may choose the device layout)."""
        if isinstance(obj, QTensor):
            return self.qweight(obj, role)
        if isinstance(obj, np.ndarray) and self.on_device:
            return self.weight(obj)
        return obj

    def placing(self, transform, cfg=None, shard=None):
        """A ``load_weights`` transform that uploads each weight as soon as it is loaded (or quantized), so
        the host holds one tensor at a time: weights go to the device once, shard by shard. On the Numba
        backend each quantized weight is packed for the kernels as it arrives, and the mapped pages the packed
        layout replaces are handed back (``toolkit/cpu/decoders.pack_experts``): memory holds it once.

        With ``cfg``, the embeddings and LM head this backend keeps 16-bit (``keeps16``) are made so here, as
        they arrive, not by the model at the end of the load (an f32 copy of each table held through the whole
        load was most of a load's peak over its end: Qwen3-30B-A3B's two are 2.5 GB): a table the file stores in
        that 16-bit type is kept as stored, a view of the mapped file when the loader offers one
        (``load.table16()``); another is narrowed from its f32 load, a step of ``STORED_ROWS`` rows at a time.
        Attention's projections (the roles its part names in ``dense16``) are kept so too, from ``DENSE16_MIN``
        elements, on the backends that read 16-bit weights (``dense``): an f32 copy of each, held from its read to
        the model's build, was 4x the bytes the model keeps of them (Mixtral: 160 MB a layer).

        ``shard`` (:class:`toolkit.model.shard.ExpertShard`, expert parallelism): what this process reads. A weight
        it does not hold is never read (None in its place); a routed-expert weight is read as the stack of the
        shard's experts only (``subset_load``)."""
        if self.caps.prepares_weights:
            finish = lambda out, role: cpu.prepare_weight(out, self.activations)
        elif self.on_device:
            finish = self.place
        else:
            finish = lambda out, role: out

        dense16 = set()
        if cfg is not None and self.caps.gemv16 and format16(cfg.torch_dtype) is not None:
            dense16 = {f"attn.{r}" for r in cfg.family.attention.dense16}

        def placed(role, name, load, shape, layer=None):
            if shard is not None:
                if not shard.keeps(role, layer):
                    return None
                ids = shard.layer(layer) if role in HOST_ROLES else None
                if ids is not None:  # a routed-expert weight: this process's experts only
                    sub = (len(ids),) + tuple(shape[1:])
                    return finish(transform(role, name, subset_load(load, ids, shape[0]), sub, layer), role)
            if role in HOST_ROLES and self.host_experts(layer) is not None:
                return transform(role, name, load, shape, layer)  # a hybrid layer's experts: split by MoEBlock
            if role in dense16:  # attention's projections: 16-bit as they arrive, never held f32 through the load
                if int(np.prod(shape)) < DENSE16_MIN:
                    return finish(transform(role, name, load, shape, layer), role)
                narrow = lambda out: self.dense(out, cfg.torch_dtype)
            elif cfg is None or role not in TABLES or not self.keeps16(role, cfg.hidden_size, cfg.tie_word_embeddings, cfg.torch_dtype):
                return finish(transform(role, name, load, shape, layer), role)
            else:
                narrow = lambda out: self.stored_precision(out, cfg.torch_dtype)
            stored = self.stored16(load, cfg.torch_dtype)
            out = transform(role, name, with_qtensor(load, stored) if stored is not None else load, shape, layer)
            if isinstance(out, np.ndarray):
                out = narrow(out)
            # a 16-bit table as the model keeps it (looked up, or read by qlinear's 16-bit GEMV): not prepared
            return out if isinstance(out, QTensor) and not out.fmt.quantized else finish(out, role)

        return placed

    def keeps16(self, role: str, hidden: int, tied: bool, torch_dtype) -> bool:
        """Whether this backend keeps the embeddings (``role`` 'embed') or the LM head ('lm_head') in the
        checkpoint's own 16-bit type when that holds them exactly: on numba always; on numpy from
        ``HEAD16_MIN_HIDDEN`` on (its reference qlinear dequantizes per call), the embeddings of an untied model
        always (rows are only looked up); never on a device (the CUDA kernels read f32 dense weights)."""
        if self.on_device or format16(torch_dtype) is None:
            return False
        head16 = hidden >= HEAD16_MIN_HIDDEN or self.caps.gemv16
        return head16 or (role == "embed" and not tied)

    @staticmethod
    def stored16(load, torch_dtype) -> QTensor | None:
        """The table ``load`` offers as stored (``load.table16()``: a view, nothing copied) when the file stores it
        in ``torch_dtype``'s 16-bit type and every value is finite; None otherwise (the f32 load then decides, and
        names a NaN)."""
        view = getattr(load, "table16", None)
        qt = view() if view is not None else None
        if qt is None or qt.fmt.name != format16(torch_dtype):
            return None
        (a,) = qt.arrays.values()
        for i in range(0, a.shape[0], STORED_ROWS):
            if not np.isfinite(a[i:i + STORED_ROWS].astype(np.float32)).all():
                return None
        return qt

    def stored_precision(self, a, torch_dtype: str):
        """A full-precision weight kept in the checkpoint's own 16-bit type when that holds it exactly (the
        embeddings and LM head of an fp16 / bf16 model: half the bytes a decode step reads for the head);
        f32 otherwise, and always f32 on a device (the CUDA kernels read f32 dense weights)."""
        name = format16(torch_dtype)
        if name is None or self.on_device or isinstance(a, QTensor) or not isinstance(a, np.ndarray):
            return a
        fmt = get_format(name)
        if a.ndim != 2:
            return a
        # STORED_ROWS rows at a time: the check's f32 copies stay small (a whole 8192 x 4096 table narrowed at
        # once held an f32 copy and its round trip, 268 MB, on top of the table: most of a load's peak over its end)
        out = None
        for i in range(0, a.shape[0], STORED_ROWS):
            c = np.ascontiguousarray(a[i:i + STORED_ROWS], dtype=np.float32)  # [r, D]
            if not np.isfinite(c).all():
                return a
            with np.errstate(over="ignore"):
                part = fmt.quantize(c, "numpy", name="weight")
            if not np.array_equal(part.dequantize("numpy"), c):
                return a
            if out is None:
                out = {k: np.empty((a.shape[0],) + v.shape[1:], v.dtype) for k, v in part.arrays.items()}
            for k, v in part.arrays.items():
                out[k][i:i + len(v)] = v
        return QTensor(fmt, tuple(a.shape), out) if out is not None else a

    def dense(self, a, torch_dtype: str):
        """A dense projection weight (attention's q/k/v/o) as this backend reads it: on ``numba`` the checkpoint's
        16-bit type when that holds it exactly (``stored_precision``): half the bytes a decode step streams and
        holds (Mixtral layer: 168 -> 84 MB), read by qlinear's 16-bit GEMV at one token (the compiled decode step
        binds the same kernel) and by its tile decode + BLAS at prefill. f32 otherwise and on the other backends
        (NumPy's reference qlinear dequantizes per call; the CUDA kernels read f32 dense weights), and below
        ``DENSE16_MIN`` elements."""
        if not self.caps.gemv16 or not isinstance(a, np.ndarray) or a.size < DENSE16_MIN:
            return a
        return self.stored_precision(a, torch_dtype)

    def ids(self, a: np.ndarray):
        """Host token ids / lengths -> int32 on the backend (a counted copy on a device)."""
        a = np.ascontiguousarray(a, dtype=np.int32 if self.on_device else np.int64)
        return self.device.to_device(a) if self.on_device else a

    def host(self, a) -> np.ndarray:
        return self.device.to_host(a) if self.is_device_array(a) else np.asarray(a)

    def const(self, key, make):
        """A device array built once per process and key (shape-derived constants: never per step); on the host
        the array itself."""
        return self.ops.const(key, make) if self.on_device else make()

    def zeros(self, shape, dtype):
        return self.device.zeros(shape, dtype) if self.on_device else np.zeros(shape, dtype)

    # ---- glue between stages: ops of toolkit.ops like the layers', through the same door ------------------------
    def linear(self, x, w, b=None):
        """``x [T, K] @ w [N, K].T (+ b)`` for a dense f32 weight."""
        return self.op("linear")(x, w, b)

    def bias_add(self, y, b):
        """``y [T, N] + b [N]`` (a new array on the CPU, in place on a device)."""
        return self.op("bias_add")(y, b)

    def embedding(self, ids, table):
        """``ids [N]`` -> rows of ``table [V, D]``: ``[N, D]`` f32 (a 16-bit table is widened row by row)."""
        return self.op("embedding")(ids, table)

    def add(self, h, y):
        """``h + y`` (the residual connection; in place but on the reference backend)."""
        return self.op("add")(h, y)

    def clip(self, x, c: float):
        """``x`` clamped to ``[-c, c]`` (OLMoE's clip_qkv): a new array on the CPU, in place on a device."""
        return self.op("clip")(x, c)

    def gated_add(self, h, s, g):
        """``h + s * sigmoid(g)`` (a shared expert's sigmoid gate): ``h, s [T, D]``, ``g [T, 1]``."""
        return self.op("gated_add")(h, None, s, g)

    def gather_rows(self, x, rows: np.ndarray):
        """``x [R, C]`` -> ``x[rows]`` (each sequence's last token); ``rows`` a host array."""
        return self.op("gather_rows")(x, self.ids(rows))


def with_qtensor(load, qt: QTensor):
    """``load`` that also offers ``qt`` as the weight as stored (``load.qtensor()``: a transform keeps it unless
    its policy names a format)."""
    def loaded(*a):
        return load(*a)

    loaded.qtensor = lambda: qt
    return loaded


def table16(a, shape) -> QTensor | None:
    """A 16-bit ``a`` of ``shape`` as an f16 / bf16 QTensor over the same memory (nothing copied); None for
    another dtype."""
    a = np.asarray(a)  # a memmap's base-class view: the kernels take plain arrays
    for name in ("f16", "bf16"):
        fmt = get_format(name)
        if a.dtype == fmt.arrays(tuple(shape))["weight"].dtype and tuple(a.shape) == tuple(shape):
            return QTensor(fmt, tuple(shape), {"weight": a})
    return None
