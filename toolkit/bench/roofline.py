"""The roofline of the grouped expert GEMM on an H200: what the hardware allows, per format and batch.

``rows(formats, tokens)``: for Mixtral's GEMM1 (gate+up, E=8, top-2, D=4096 -> 2I=28672) and GEMM2 (down,
I=14336 -> D) at M tokens, the bytes a kernel must move (the stored bytes of the experts the routing touches,
expected for uniform routing: E (1 - (1 - A/E)^M); f16 activations in, f32 results out) and the FLOPs
(2 M A K N), the ideal time at HBM_BYTES_S and at the dense tensor peak (f16/bf16; e4m3 for W8A8), which of the
two bounds it, and the issue's target where it set one. ``measured`` (us per row key) adds the measured time and
its fraction of the ideal. Printed by ``python -m toolkit.bench cuda --model-only`` (no GPU needed) and beside the
measured GEMM1 rows when a GPU runs the bench.
"""
from __future__ import annotations

from ..formats import get_format

HBM_BYTES_S = 4.26e12  # H200: a measured device-to-device copy (spec 4.8 TB/s)
PEAK = {"f16": 989e12, "e4m3": 1979e12}  # dense tensor-core FLOP/s, H100/H200 SXM
E, A, D, I = 8, 2, 4096, 14336  # Mixtral 8x7B
GEMMS = {"GEMM1": (2 * I, D), "GEMM2": (D, I)}  # name -> (N, K)
TARGETS_US = {("GEMM1", 1, "int4"): 45, ("GEMM1", 1, "int8"): 80, ("GEMM1", 1, "fp8"): 80,
              ("GEMM1", 64, "int4"): 160, ("GEMM1", 64, "int8"): 300, ("GEMM1", 64, "fp8"): 300}
TARGETS_TFLOPS = {("GEMM1", 4096, "fp8"): 600, ("GEMM1", 4096, "int4"): 350}


def experts_touched(M: int) -> float:
    return E * (1 - (1 - A / E) ** M)


def ideal(fmt_spec: str, gemm: str, M: int) -> dict:
    fmt = get_format(fmt_spec)
    N, K = GEMMS[gemm]
    w_bytes = fmt.nbytes((1, N, K))  # one expert's stored bytes, scales included
    x_bytes = (M if gemm == "GEMM1" else M * A) * K * (1 if fmt.act_quant is not None else 2)
    moved = experts_touched(M) * w_bytes + x_bytes + M * A * N * 4
    flops = 2.0 * M * A * K * N
    peak = PEAK["e4m3" if fmt.act_quant is not None else "f16"]
    t_mem, t_flop = moved / HBM_BYTES_S, flops / peak
    return {"bits/w": 8 * w_bytes / (N * K), "experts": experts_touched(M), "MB moved": moved / 1e6,
            "GFLOP": flops / 1e9, "FLOP/byte": flops / moved, "HBM us": t_mem * 1e6, "tensor us": t_flop * 1e6,
            "ideal us": max(t_mem, t_flop) * 1e6, "bound": "memory" if t_mem >= t_flop else "compute"}


def target_us(fmt_spec: str, gemm: str, M: int):
    base = get_format(fmt_spec).name
    if (gemm, M, base) in TARGETS_US:
        return TARGETS_US[(gemm, M, base)]
    if (gemm, M, base) in TARGETS_TFLOPS:
        N, K = GEMMS[gemm]
        return 2.0 * M * A * K * N / (TARGETS_TFLOPS[(gemm, M, base)] * 1e12) * 1e6
    return "-"


def rows(formats: list[str], tokens: list[int], gemms=("GEMM1", "GEMM2"), measured: dict | None = None) -> list[dict]:
    out = []
    for gemm in gemms:
        for spec in formats:
            for M in tokens:
                r = {"gemm": gemm, "format": spec, "M": M, **ideal(spec, gemm, M), "target us": target_us(spec, gemm, M)}
                if measured is not None:
                    t = measured.get((gemm, spec, M))
                    r["measured us"] = t if t is not None else "-"
                    r["of ideal"] = r["ideal us"] / t if t else "-"
                out.append(r)
    return out
