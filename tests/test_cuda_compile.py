"""Every kernel and template instantiation of cuda_src/ compiles with NVRTC for sm_80 and sm_90 (no GPU
needed): no error, no warning, no spilled bytes. Registers per kernel are recorded as user properties and
printed as one table at the end of the module (also: python -m toolkit.gpu.nvrtc).
"""
from __future__ import annotations

import pytest

from toolkit.gpu import CUDA_SOURCES, nvrtc
from toolkit.gpu.source import cuda_include_dirs

NVRTC_MISSING = nvrtc.missing_reason()

pytestmark = pytest.mark.skipif(NVRTC_MISSING is not None, reason=str(NVRTC_MISSING))
RESULTS: list[nvrtc.CompileResult] = []


@pytest.fixture(scope="module", autouse=True)
def register_table(request):
    yield
    if RESULTS:
        capman = request.config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled():
            print("\n\nNVRTC registers / spills per kernel\n" + nvrtc.table(RESULTS))


def test_cuda_headers_found():
    assert cuda_include_dirs(), "cuda_fp16.h not found in the pip CUDA packages, $CUDA_PATH or /usr/local/cuda"


@pytest.mark.parametrize("arch", nvrtc.ARCHS)
@pytest.mark.parametrize("stem", CUDA_SOURCES)
def test_compiles_without_warnings_or_spills(stem, arch, record_property):
    r = nvrtc.compile_stem(stem, arch)
    RESULTS.append(r)
    assert not r.warnings, f"{stem}.cu sm_{arch}: warnings:\n" + "\n".join(r.warnings)
    for k in r.kernels:
        record_property(f"sm_{arch} {k.kernel}", f"{k.registers} registers, {k.spill_stores + k.spill_loads} spill bytes")
        assert k.registers > 0, f"{stem}.cu sm_{arch}: no ptxas report for {k.kernel}\n{r.log}"
        assert k.spill_stores == 0 and k.spill_loads == 0, (
            f"{stem}.cu sm_{arch}: {k.kernel} spills {k.spill_stores} bytes stored / {k.spill_loads} loaded")
