"""Every kernel and template instantiation of cuda_src/ compiles with NVRTC for sm_80 and sm_90 (no GPU
needed): no error, no warning, no spilled bytes, under two compilers: the NVRTC installed here (the newest of the
cuda13 extra) and the one of the GPU machine's image (``nvrtc.IMAGE_NVRTC``, run in a child process: its ptxas
spilled kernels the newest did not). Registers per kernel are recorded as user properties and printed as one
table per compiler at the end of the module (also: python -m toolkit.gpu.nvrtc).
"""
from __future__ import annotations

import os

import pytest

from toolkit.gpu import CUDA_SOURCES, nvrtc
from toolkit.gpu.source import cuda_include_dirs

NVRTC_MISSING = nvrtc.missing_reason()

pytestmark = pytest.mark.skipif(NVRTC_MISSING is not None, reason=str(NVRTC_MISSING))
RESULTS: dict[str, list[nvrtc.CompileResult]] = {}
COMPILERS = ["installed", "image"]


def image_results(stems, archs) -> dict:
    """(stem, arch) -> CompileResult under the image's NVRTC, compiled once in a child process. Absent: a skip
    naming how to install it, or a failure in CI (.ci/test installs it: the leg must run there)."""
    lib = nvrtc.image_nvrtc_dir()
    if lib is None:
        why = (f"the GPU image's NVRTC {nvrtc.IMAGE_NVRTC} is not installed (pip install --no-deps --target "
               f".venv/nvrtc-{nvrtc.IMAGE_NVRTC} nvidia-cuda-nvrtc=={nvrtc.IMAGE_NVRTC}, as .ci/test does)")
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    version, results = nvrtc.compile_with(lib, stems, archs)
    want = tuple(int(x) for x in nvrtc.IMAGE_NVRTC.split(".")[:2])
    assert version == want, f"the child loaded NVRTC {version}, not the image's {want}"
    return {(r.stem, r.arch): r for r in results}


@pytest.fixture(scope="module")
def compiled():
    """compiled(compiler, stem, arch) -> CompileResult."""
    image = {}

    def get(compiler, stem, arch):
        if compiler == "installed":
            r = nvrtc.compile_stem(stem, arch)
        else:
            if not image:
                image.update(image_results(CUDA_SOURCES, nvrtc.ARCHS))
            r = image[(stem, arch)]
        RESULTS.setdefault(compiler, []).append(r)
        return r

    return get


@pytest.fixture(scope="module", autouse=True)
def register_table(request):
    yield
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        for compiler, results in RESULTS.items():
            print(f"\n\nNVRTC registers / spills per kernel ({compiler})\n" + nvrtc.table(results))


def test_cuda_headers_found():
    assert cuda_include_dirs(), "cuda_fp16.h not found in the pip CUDA packages, $CUDA_PATH or /usr/local/cuda"


@pytest.mark.parametrize("arch", nvrtc.ARCHS)
@pytest.mark.parametrize("stem", CUDA_SOURCES)
@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiles_without_warnings_or_spills(compiled, compiler, stem, arch, record_property):
    r = compiled(compiler, stem, arch)
    assert not r.warnings, f"{stem}.cu sm_{arch}: warnings:\n" + "\n".join(r.warnings)
    for k in r.kernels:
        record_property(f"{compiler} sm_{arch} {k.kernel}", f"{k.registers} registers, {k.spill_stores + k.spill_loads} spill bytes")
        assert k.registers > 0, f"{stem}.cu sm_{arch}: no ptxas report for {k.kernel}\n{r.log}"
        assert k.spill_stores == 0 and k.spill_loads == 0, (
            f"{stem}.cu sm_{arch}: {k.kernel} spills {k.spill_stores} bytes stored / {k.spill_loads} loaded")


def test_compile_results_are_kept_under_a_key_of_what_decides_them(tmp_path, monkeypatch):
    """compile_stem's disk cache (the compile and PTX gates run in different workers): the key changes with the
    architecture, the options, the name expressions and the loaded NVRTC; a hit is what compiling gives; without
    a known library nothing is kept."""
    import dataclasses

    monkeypatch.setenv("MOQE_CACHE_DIR", str(tmp_path))
    names, opts = nvrtc.kernels("add"), [*nvrtc.nvrtc_options(), *nvrtc.OPTIONS, "-arch=sm_90"]
    key = nvrtc._cache_path("add", 90, names, opts)
    assert key.parent.is_relative_to(tmp_path)
    others = [nvrtc._cache_path("add", 80, names, opts[:-1] + ["-arch=sm_80"]),
              nvrtc._cache_path("add", 90, names, opts + ["-lineinfo"]), nvrtc._cache_path("add", 90, (*names, "another_kernel"), opts)]
    assert len({key, *others}) == 4
    nvrtc.compile_stem.cache_clear()
    try:
        fresh = nvrtc.compile_stem("add", 90)
        assert key.is_file()
        nvrtc.compile_stem.cache_clear()
        assert dataclasses.asdict(nvrtc.compile_stem("add", 90)) == dataclasses.asdict(fresh)
        monkeypatch.setattr(nvrtc, "_loaded_nvrtc", lambda: "another build")
        assert nvrtc._cache_path("add", 90, names, opts) != key
        monkeypatch.setattr(nvrtc, "_loaded_nvrtc", lambda: "")
        assert nvrtc._cache_path("add", 90, names, opts) is None
    finally:
        nvrtc.compile_stem.cache_clear()
