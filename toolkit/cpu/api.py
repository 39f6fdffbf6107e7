"""The Numba backend as the model sees it: everything ``toolkit/model`` uses of ``toolkit/cpu`` goes through this
module (tests/test_layout.py checks that model/ imports nothing else from the backends), so the kernels' modules can
change behind it. Names load on first use (PEP 562): importing this module compiles and imports nothing.

- activations: ``check_activations``, ``prepare_weight`` (pack a quantized weight for its kind as it is
  loaded), ``mark_activations`` / ``prepared_kind``, ``int8_applies``, ``kernel_for`` (a format's f32-path GEMM
  preparation);
- the compiled decode step (``toolkit/model/decode_step.py``): ``DECODERS``, ``dense_arg``,
  ``decode_layer_kernel``, ``step_weight``, ``ready`` / ``ready_sig`` / ``signature`` (is a build compiled or
  cached), ``PARALLEL_MIN_WORK`` / ``parallel_threshold`` (the parallel builds);
- memory: ``held_arrays`` (the packed layouts a weight holds), ``decoder_for``, ``pack_int`` (the integer
  kernels' packing, for ``moqe info``'s estimate);
- the rest: ``kv_rotate`` (a rotated key cache at one token), ``start_detached`` (the cold start's background
  compile).
"""
from __future__ import annotations

from ..lazy import lazy_getattr

_WHERE = {  # name -> (module of toolkit.cpu, its name there)
    "check_activations": ("moe_gemm", "check_activations"), "prepare_weight": ("moe_gemm", "prepare_weight"),
    "mark_activations": ("moe_gemm", "mark_activations"), "prepared_kind": ("moe_gemm", "prepared_kind"),
    "int8_applies": ("moe_gemm", "int8_applies"), "kernel_for": ("moe_gemm", "kernel_for"),
    "DECODERS": ("decoders", "DECODERS"), "decoder_for": ("decoders", "decoder_for"),
    "held_arrays": ("decoders", "held_arrays"),
    "dense_arg": ("decode_layer", "dense_arg"), "decode_layer_kernel": ("decode_layer", "kernel"),
    "step_weight": ("igemm", "step_weight"), "pack_int": ("igemm_pack", "pack"),
    "ready": ("_jit", "ready"), "ready_sig": ("_jit", "ready_sig"), "signature": ("_jit", "signature"),
    "PARALLEL_MIN_WORK": ("_jit", "PARALLEL_MIN_WORK"), "parallel_threshold": ("_jit", "parallel_threshold"),
    "kv_rotate": ("kv_rotate", "kv_rotate"), "start_detached": ("_detached", "start_detached"),
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_getattr(globals(), _WHERE)
