"""Shared test fixtures. Numba kernels run single-process; keep hypothesis deadlines off (JIT warm-up)."""
import os

from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=60, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402


@pytest.fixture(params=["serial", "parallel"])
def kernel_build(request, monkeypatch):
    """Run a test with the serial and with the parallel build of every Numba kernel (toolkit/cpu/_jit.py)."""
    import toolkit.cpu._jit as jit

    monkeypatch.setattr(jit, "PARALLEL_MIN_WORK", 1 << 62 if request.param == "serial" else 0)
    return request.param


@pytest.fixture(autouse=True)
def expert_activations(request, monkeypatch):
    """The numba expert GEMMs' activations in a test: f32 (exact: what the references and the other backends
    compute) unless the test is marked ``@pytest.mark.activations("int8")``. The library's default, int8, is held
    to its spec by tests/test_igemm.py and the int8 cases of tests/test_moe_pipeline.py and tests/test_parity_hf.py
    (those set it explicitly), and a command run in a subprocess gets it as a user does."""
    from toolkit.cpu import moe_gemm

    marker = request.node.get_closest_marker("activations")
    monkeypatch.setattr(moe_gemm, "DEFAULT_ACTIVATIONS", marker.args[0] if marker else "f32")
    return moe_gemm.DEFAULT_ACTIVATIONS


# test files that must share a worker under `-n N --dist loadfile` (.ci/test): the PTX gate compiles the same kernels
# as the compile gate, so after it in the same process every compile is a cache hit (nvrtc.compile_stem); in two
# workers they compiled each stem twice, at the same time
SAME_WORKER = {"tests/test_cuda_ptx_gate.py": "tests/test_cuda_compile.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

    return FilesTogether(config, log)
