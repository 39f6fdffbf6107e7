"""embedding: ``ids [N], table [V, D] -> [N, D]`` f32, the rows ``table[ids]``; an id outside ``[0, V)`` gives a
row of zeros (the host validates ids; the CUDA kernel must never read outside the table). The same gather as
``gather_rows``, with the table as the matrix. ``table`` may be a QTensor of a 16-bit format (f16 / bf16, the
checkpoint's own type: ``Runtime.stored_precision``): its rows are widened to f32."""
import numpy as np

from .gather_rows import gather_rows


def embedding(ids: np.ndarray, table) -> np.ndarray:
    if not isinstance(table, np.ndarray):  # a 16-bit QTensor [V, D]: one array "weight"
        table = table.arrays["weight"]
    return gather_rows(table, ids)
