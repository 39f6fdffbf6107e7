"""CUDA backend: launchers for the kernels in ``cuda_src/<op>.cu`` (same stem as ``toolkit/ref/<op>.py``).

Each ``toolkit/gpu/<op>.py`` exports
- ``SOURCE`` (the .cu stem) and ``KERNELS`` (every kernel / template instantiation the launcher uses: the
  NVRTC name expressions, compiled by tests/test_cuda_compile.py for sm_80 and sm_90);
- ``check_<op>(...)``: the layout contract (dtype, contiguity, shapes), a pure function that raises
  :class:`~toolkit.errors.BackendError` naming the op and the broken condition;
- ``run_<op>(rt, ...)``: the launch plan, written once against a runner ``rt`` (``launch.CupyRunner`` on a
  GPU, ``launch.EmuRunner`` on the CPU through ``cuda_src/emu``), so the emulated tests run the launcher
  itself;
- ``<op>(...)``: the backend entry point of :func:`toolkit.ops.get_op` (needs CuPy and a GPU).
"""
CUDA_OPS = ("topk_softmax", "topk_sigmoid", "topk_softmax_grouped", "moe_align", "silu_and_mul", "clamped_swiglu", "moe_bias_add", "moe_combine", "fp8_act_quant", "rms_norm", "moe_gemm", "moe_gemm_mma",
            "kv_store", "kv_attention", "kv_attention_mma", "mla_q", "mla_kv", "mla_out", "embedding", "rope", "add", "bias_add", "gated_add", "clip", "gather_rows", "positions",
            "sample", "nll")
