"""Unquantized formats: f32, f16, bf16 (one array ``weight`` of the tensor's own shape)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .base import ArraySpec, Codec, Format


def _layout(dtype):
    def layout(fmt: Format, shape: tuple) -> dict:
        return {"weight": ArraySpec(np.dtype(dtype), shape)}

    return layout


def _codec(dtype) -> Codec:
    def quantize(w: np.ndarray, fmt: Format) -> dict:
        return {"weight": np.ascontiguousarray(w.astype(dtype))}  # round to nearest even

    def dequantize(arrays, fmt: Format, shape: tuple) -> np.ndarray:
        return np.asarray(arrays["weight"], dtype=np.float32).reshape(shape)

    return Codec(quantize, dequantize)


def _dense(name: str, dtype, doc: str, max_abs: float | None = None, **layers) -> Format:
    codec = _codec(dtype)
    # a cast has no kernel worth writing: numba's codec is numpy's (one vectorised cast)
    return Format(name=name, kind="dense", bits=np.dtype(dtype).itemsize * 8, group_size=1, doc=doc,
                  layout=_layout(dtype), codecs={"numpy": codec, "numba": codec}, quantized=False,
                  max_abs=max_abs, **layers)


F32 = _dense("f32", np.float32, "IEEE float32, unquantized", cpu_decoder="dense_f32", cuda_decoder="F32Dec",
             kv_row="F32Row", ggml_type=0)
F16 = _dense("f16", np.float16, "IEEE float16, unquantized", max_abs=65504.0, cpu_decoder="dense_table16",
             ggml_type=1)
BF16 = _dense("bf16", ml_dtypes.bfloat16, "bfloat16, unquantized", cpu_decoder="dense_table16", ggml_type=30)
FORMATS = (F32, F16, BF16)
