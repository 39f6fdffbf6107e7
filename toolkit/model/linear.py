"""The model's linear layer: a dense f32 weight through BLAS (cuBLAS on a device), a quantized one through
the backend's ``qlinear`` op, chosen once when the layer is built."""
from __future__ import annotations

import numpy as np

from ..formats import QTensor
from .runtime import Runtime


class Linear:
    """``y = x @ W.T (+ b)``: [T, in] -> [T, out]. A dense f32 weight goes to BLAS (cuBLAS on a device); a
    quantized one (:class:`~toolkit.formats.QTensor`) to the ``qlinear`` op of the backend, chosen here, once."""

    def __init__(self, weight, bias=None, rt: Runtime | None = None):
        rt = rt or Runtime("numba")
        self.bias = rt.weight(bias)
        if isinstance(weight, QTensor):
            self.weight = rt.qweight(weight)  # [out, in] quantized
            op, w = rt.op("qlinear"), self.weight

            def matmul(x):
                y = op(x if rt.on_device else np.ascontiguousarray(x, dtype=np.float32), w)
                return y if self.bias is None else rt.bias_add(y, self.bias)
            self._matmul = matmul
        else:
            self.weight = rt.weight(weight)  # [out, in]
            self._matmul = lambda x: rt.linear(x, self.weight, self.bias)

    def __call__(self, x):
        return self._matmul(x)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)
