"""The format registry and cuda_src/formats.cuh agree: every decoder and KV row struct a Format record names
exists, and the byte sizes the C++ side declares equal the Python layouts. The header is compiled on the host
(g++, with the emulation layer's CUDA stand-ins) and a tiny program prints the sizes."""
from __future__ import annotations

import re
import subprocess

import pytest

from toolkit.formats import FORMATS
from toolkit.gpu import emulate
from toolkit.gpu.source import CUDA_SRC

HEADER = (CUDA_SRC / "formats.cuh").read_text()
BLOCK_STRUCTS = {"q8_0": "block_q8_0", "q4_0": "block_q4_0", "mxfp4": "block_mxfp4"}  # GGML formats: their C block struct
GGML_DECODERS = [f for f in FORMATS.values() if f.kind == "ggml"]  # q4_1 .. q6_K: VALUES / BYTES on the decoder


@pytest.fixture(scope="module")
def sizes(tmp_path_factory) -> dict[str, int]:
    d = tmp_path_factory.mktemp("cuh")
    rows = [f for f in FORMATS.values() if f.kv_row]
    lines = ['#include "formats.cuh"', "#include <cstdio>", "int main() {"]
    lines += [f'  std::printf("{s} %zu\\n", sizeof({s}));' for s in BLOCK_STRUCTS.values()]
    lines += [f'  std::printf("{f.kv_row} %d\\n", {f.kv_row}::BLOCK_BYTES);' for f in rows]
    lines += [f'  std::printf("{f.name} %d/%d\\n", {f.cuda_decoder}::VALUES, {f.cuda_decoder}::BYTES);' for f in GGML_DECODERS]
    lines += ["  return 0;", "}"]
    src, exe = d / "sizes.cpp", d / "sizes"
    src.write_text("\n".join(lines) + "\n")
    cmd = [emulate.CXX, "-std=c++20", f"-I{emulate.EMU_DIR / 'include'}", "-include", str(emulate.EMU_DIR / "cuda_emu.h"),
           f"-I{CUDA_SRC}", str(src), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {name: n if "/" in n else int(n) for name, n in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if f.cuda_decoder or f.kv_row], ids=lambda f: f.name)
def test_every_named_struct_exists(fmt):
    for name in filter(None, (fmt.cuda_decoder, fmt.kv_row)):
        base = name.split("<")[0]
        assert re.search(rf"\b(struct|using) {re.escape(base)}\b", HEADER), f"{fmt.name}: no struct {base} in formats.cuh"


@pytest.mark.parametrize("name,struct", BLOCK_STRUCTS.items())
def test_block_sizes_match_the_python_layout(sizes, name, struct):
    fmt = FORMATS[name]
    values, nbytes = fmt.block
    assert sizes[struct] == nbytes == fmt.nbytes((1, values)), (name, sizes[struct], fmt.block)


@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if f.kv_row], ids=lambda f: f.name)
def test_kv_row_block_bytes_match(sizes, fmt):
    assert sizes[fmt.kv_row] == fmt.nbytes((1, 32)), (fmt.name, sizes[fmt.kv_row])


@pytest.mark.parametrize("fmt", GGML_DECODERS, ids=lambda f: f.name)
def test_ggml_decoder_block_matches_the_python_layout(sizes, fmt):
    values, nbytes = fmt.block
    assert sizes[fmt.name] == f"{values}/{nbytes}" and fmt.nbytes((1, values)) == nbytes, (fmt.name, sizes[fmt.name])
