"""embedding on the CPU: ``ids [N]`` -> rows of ``table [V, D]`` as ``[N, D]`` f32; a 16-bit table (a QTensor
of f16 / bf16, ``Runtime.stored_precision``) is widened only in the rows read. Ids outside ``[0, V)`` give rows
of zeros, as the reference and the CUDA kernel do."""
import numpy as np

from ..formats import QTensor
from .gather_rows import gather_rows


def embedding(ids, table):
    if isinstance(table, QTensor):  # [V, D] f16 / bf16: one array "weight"
        return gather_rows(table.arrays["weight"], ids).astype(np.float32)
    return gather_rows(table, ids)  # [N, D]
