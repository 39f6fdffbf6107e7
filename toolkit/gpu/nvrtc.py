"""Compile every kernel of ``cuda_src/`` with NVRTC (no GPU needed) and report registers and spills.

``compile_stem(stem, arch)`` compiles ``cuda_src/<stem>.cu`` to a cubin for ``sm_<arch>`` with all the name
expressions its launcher uses (``toolkit/gpu/<stem>.py: KERNELS``) and ``--ptxas-options=-v``; ptxas then
prints, per kernel, the registers, shared memory, stack frame and spill bytes into the program log, which is
parsed into one :class:`KernelInfo` per name expression, with the PTX of that kernel's entry (``ptx``: what
tests/test_cuda_ptx_gate.py checks the instructions of) and, for the stems of ``SASS_STEMS`` where ``nvdisasm`` is
installed (:func:`nvdisasm`: the cuda13 extra's ``cuda-toolkit[nvdisasm]``), the HMMA count and length of the main
loop of its SASS (``sass_mma``, ``sass_loop``: what the SM issues, which occupancy.decode_issue counts). Cached per
(stem, arch) for the process, and on disk (``<cache>/nvrtc``) under a key of everything that decides the result
(:func:`_cache_path`).
``python -m toolkit.gpu.nvrtc`` prints the table.
Uses CuPy's NVRTC bindings (``cupy.cuda.nvrtc``; the cuda12 / cuda13 extras) and the CUDA headers found by
:func:`toolkit.gpu.source.cuda_include_dirs`.

Another NVRTC: a process loads one libnvrtc, so :func:`compile_with` runs ``python -m toolkit.gpu.nvrtc --json`` in
a child whose ``libnvrtc.so`` is the one in ``lib_dir`` (``LD_PRELOAD``): the compile and PTX gates run under the
NVRTC of the GPU machine's image (``IMAGE_NVRTC``, CUDA 13.0: its ptxas allocates registers differently and
spilled kernels that 13.5 does not) as well as the installed one. ``.ci/test`` installs that library into
``.venv/nvrtc-<version>`` (:func:`image_nvrtc_dir`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .source import arch_name, cu_path, kernels, nvrtc_options

ARCHS = (80, 90)
SASS_STEMS = ("moe_gemm_mma",)  # whose SASS main loops are read (occupancy.decode_issue): nvdisasm, 4 s its cubin
OPTIONS = ("--ptxas-options=-v",)  # beside the GPU's own options (source.nvrtc_options): the same compile, reported
_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for 'sm_(?P<arch>\d+)a?'")
_FRAME = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads")
_REGS = re.compile(r"Used (?P<regs>\d+) registers")
_SMEM = re.compile(r"(?P<smem>\d+) bytes smem")
_PTX_ENTRY = re.compile(r"^\.(?:visible|weak) \.entry (?P<name>\w+)\(", re.M)


@dataclasses.dataclass
class KernelInfo:
    stem: str
    kernel: str  # name expression
    arch: int
    registers: int = -1
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0  # static shared memory, bytes
    ptx: str = dataclasses.field(default="", repr=False)  # this kernel's .entry in the module's PTX
    sass_mma: int = 0  # HMMA instructions in the main loop of its SASS (0: not disassembled)
    sass_loop: int = 0  # instructions in that loop (sass_main_loop)
    sass_inner_mma: int = 0  # HMMA in the loop nested in it (block_m 128's sub-tile loop: sass_inner_loop), 0: none
    sass_inner_loop: int = 0  # instructions in that nested loop


@dataclasses.dataclass
class CompileResult:
    stem: str
    arch: int
    log: str
    kernels: list[KernelInfo]

    @property
    def warnings(self) -> list[str]:
        # ptxas' "Potential Performance Loss" advisories too (wgmma serialized: it waits for each wgmma)
        return [ln for ln in self.log.splitlines() if re.search(r"\bwarning\b|performance loss", ln, re.I)]


def missing_reason() -> str | None:
    """Why NVRTC cannot compile here (no CuPy, or no libnvrtc), or None: the compile tests skip with it."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return None
    except Exception as e:  # noqa: BLE001 - any import or load failure means the same: no NVRTC
        return f"NVRTC not importable ({type(e).__name__}: {e}); install the cuda12 or cuda13 extra"


def _nvrtc_paths() -> list[str]:
    """The libnvrtc files this process mapped (``/proc/self/maps``; CuPy loads them on its first call): the
    library, and its ``.alt`` twin where loaded."""
    version()
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if re.search(r"/libnvrtc\.(alt\.)?so[.\d]*$", line.strip())})


def _loaded_nvrtc() -> str:
    """The libnvrtc this process loaded: its path, size and modification time, or '' when unknown (then nothing is
    cached on disk)."""
    try:
        return ";".join(f"{p}:{(st := os.stat(p)).st_size}:{st.st_mtime_ns}" for p in _nvrtc_paths())
    except OSError:
        return ""


@functools.cache
def nvdisasm() -> str | None:
    """The ``nvdisasm`` that reads NVRTC's cubins into SASS, as CuPy's locator finds CUDA's tools
    (``cuda.pathfinder``: the pip wheels, the cuda13 extra's ``cuda-toolkit[nvdisasm]`` among them, conda,
    ``$CUDA_PATH``, ``$PATH``), or None (then only PTX is counted)."""
    try:
        from cuda import pathfinder

        return pathfinder.find_nvidia_binary_utility("nvdisasm")
    except Exception:  # noqa: BLE001 - an older CuPy without it, or nothing found
        return None


def _cubin(prog) -> bytes:
    """The program's cubin, every byte of it: CuPy's ``getCUBIN`` returns one byte short of nvrtcGetCUBINSize
    (NVRTC 13.x, CuPy 14.2: a program header cut, which nvdisasm then refuses), so the library is called directly."""
    import ctypes

    lib = ctypes.CDLL(next(p for p in _nvrtc_paths() if ".alt." not in p))
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) != 0:
        raise RuntimeError("nvrtcGetCUBINSize failed")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf) != 0:
        raise RuntimeError("nvrtcGetCUBIN failed")
    return buf.raw


def _loops(lines: list[str], label: re.Pattern, back: re.Pattern, keep, mma: str) -> list[tuple[int, int, int, list]]:
    """Every loop of a listing holding ``mma`` instructions: (first line, last line, ``mma`` count, instructions)."""
    at = {m.group(1): i for i, line in enumerate(lines) if (m := label.match(line))}
    found = []
    for i, line in enumerate(lines):
        m = back.search(line)
        if m and at.get(m.group(1), i) < i:
            body = [x.strip() for x in lines[at[m.group(1)]:i + 1] if keep(x)]
            n = sum(mma in x for x in body)
            if n:
                found.append((at[m.group(1)], i, n, body))
    return found


def main_loop(lines: list[str], label: re.Pattern, back: re.Pattern, keep, mma: str) -> tuple[int, list[str]]:
    """(``mma`` count, instructions) of a kernel's main loop in a listing (PTX, or nvdisasm's SASS): the loop (a
    ``label`` line and a ``back`` branch to it, each giving the label as group 1) holding the most ``mma``
    instructions; ``keep(line)``: whether a line is an instruction. Counted statically: the loops inside it have
    fixed trip counts and are unrolled, so this is what one pass executes, both arms of its few branches included
    (but a loop left rolled inside it, as block_m 128's sub-tile loop: :func:`inner_loop`)."""
    best = max(_loops(lines, label, back, keep, mma), key=lambda x: (x[2], len(x[3])), default=None)
    return (best[2], best[3]) if best else (0, [])


def inner_loop(lines: list[str], label: re.Pattern, back: re.Pattern, keep, mma: str) -> tuple[int, list[str]]:
    """(``mma`` count, instructions) of the largest loop holding ``mma`` instructions nested in the main loop
    (:func:`main_loop`), which a pass of it runs one or more times; (0, []) where there is none."""
    loops = _loops(lines, label, back, keep, mma)
    if not loops:
        return 0, []
    a, b, _, _ = max(loops, key=lambda x: (x[2], len(x[3])))
    inner = [x for x in loops if a <= x[0] and x[1] <= b and (x[0], x[1]) != (a, b)]
    best = max(inner, key=lambda x: (x[2], len(x[3])), default=None)
    return (best[2], best[3]) if best else (0, [])


_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BACK = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")
_SASS_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+\S")  # an instruction line of nvdisasm -c: /*0230*/  OPCODE ...


def sass_main_loop(sass: str) -> tuple[int, int]:
    """(HMMA count, instructions) of a kernel's main loop in its SASS (``nvdisasm -c`` of one function), as
    occupancy.main_loop for PTX. These are what the SM issues: ptxas folds some PTX away (an f16 pack into an f16x2
    operand select, constants into immediates) and adds some (the no-op slots it schedules beside cp.async and MMA)."""
    n, body = main_loop(sass.splitlines(), _SASS_LABEL, _SASS_BACK, _SASS_INSTR.search, "HMMA")
    return n, len(body)


def sass_inner_loop(sass: str) -> tuple[int, int]:
    """(HMMA count, instructions) of the HMMA loop nested in the SASS main loop (:func:`inner_loop`), (0, 0) where
    there is none."""
    n, body = inner_loop(sass.splitlines(), _SASS_LABEL, _SASS_BACK, _SASS_INSTR.search, "HMMA")
    return n, len(body)


def sass_text(cubin: bytes) -> dict[str, str]:
    """lowered kernel name -> its SASS (``nvdisasm -c`` of the cubin)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        p = subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {p.stderr.strip()[-2000:]}")
    parts = re.split(r"^\s*\.section\s+\.text\.([\w$.]+),", p.stdout, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _sass_loops(cubin: bytes) -> dict[str, tuple[int, int, int, int]]:
    """lowered kernel name -> (HMMA, instructions) of its SASS main loop, then of the HMMA loop nested in it."""
    return {name: (*sass_main_loop(body), *sass_inner_loop(body)) for name, body in sass_text(cubin).items()}


CACHE_FORMAT = 2  # of a cached CompileResult: 2 with the nested SASS loop (KernelInfo.sass_inner_*)


def _cache_path(stem: str, arch: int, names, opts) -> Path | None:
    """Where a compile's result is kept across processes: keyed by everything that decides it (the loaded NVRTC,
    the options, the name expressions, the sources of cuda_src/ and the stat of each include folder), so a hit is
    what compiling would print. The compile and PTX gates, run by different pytest workers, compile once."""
    lib = _loaded_nvrtc()
    if not lib:
        return None
    import hashlib

    from ..paths import cache_dir

    src = cu_path(stem).parent
    sass = nvdisasm() if stem in SASS_STEMS else None
    h = hashlib.sha256(json.dumps([stem, arch, list(names), list(opts), lib, sass or "", CACHE_FORMAT]).encode())
    for f in sorted(src.glob("*.cu*")):
        h.update(f.name.encode() + f.read_bytes())
    for o in opts:
        if o.startswith("-I") and os.path.isdir(o[2:]):
            h.update(f"{o}:{os.stat(o[2:]).st_mtime_ns}".encode())
    return Path(cache_dir("nvrtc")) / f"{stem}-sm{arch}-{h.hexdigest()[:24]}.json"


def _from_json(r: dict) -> CompileResult:
    return CompileResult(r["stem"], r["arch"], r["log"], [KernelInfo(**k) for k in r["kernels"]])


@functools.cache
def compile_stem(stem: str, arch: int) -> CompileResult:
    names = kernels(stem)
    opts = [*nvrtc_options(), *OPTIONS, f"-arch={arch_name(stem, arch)}"]
    path = _cache_path(stem, arch, names, opts)
    if path is not None and path.is_file():
        try:
            return _from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged entry: compile again and replace it
    result = _compile(stem, arch, names, opts)
    if path is not None:
        from ..writes import atomic_write_text

        atomic_write_text(path, json.dumps(dataclasses.asdict(result)))
    return result


def build(stem: str, arch: int) -> tuple[bytes, dict[str, str]]:
    """``cuda_src/<stem>.cu`` as a GPU loads it where CuPy cannot compile it (an ``sm_90a`` module: CuPy's
    RawModule passes ``-arch=sm_90``): :func:`cubin_of` for :func:`~toolkit.gpu.source.arch_name`."""
    return cubin_of(cu_path(stem), kernels(stem), arch_name(stem, arch))


def cubin_of(cu: Path, names, arch: str) -> tuple[bytes, dict[str, str]]:
    """The cubin of the CUDA source ``cu`` for ``arch`` (e.g. ``sm_90a``), with the GPU's options, and the lowered
    (mangled) name of each name expression in ``names``: what ``cupy.RawModule(path=...)`` loads and looks up."""
    from cupy.cuda import nvrtc

    with _program(Path(cu), names, [*nvrtc_options(), f"-arch={arch}"], arch) as prog:
        return _cubin(prog), {n: nvrtc.getLoweredName(prog, n) for n in names}


@contextlib.contextmanager
def _program(cu: Path, names, opts, target: str):
    """An NVRTC program of ``cu`` with ``names`` as name expressions, compiled with ``opts`` (a RuntimeError with the
    program log if it fails), destroyed on exit."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(cu.read_text(), cu.name, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {cu.name} for {target}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        yield prog
    finally:
        nvrtc.destroyProgram(prog)


def _compile(stem: str, arch: int, names, opts) -> CompileResult:
    from cupy.cuda import nvrtc

    with _program(cu_path(stem), names, opts, f"sm_{arch}") as prog:
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, n): n for n in names}
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        sass = _sass_loops(_cubin(prog)) if nvdisasm() and stem in SASS_STEMS else {}
    infos, cur = {}, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            cur = KernelInfo(stem, lowered.get(m["name"], m["name"]), int(m["arch"]))
            infos[cur.kernel] = cur
        elif cur and (m := _FRAME.search(line)):
            cur.stack, cur.spill_stores, cur.spill_loads = int(m["stack"]), int(m["st"]), int(m["ld"])
        elif cur and (m := _REGS.search(line)):
            cur.registers = int(m["regs"])
            if sm := _SMEM.search(line):
                cur.smem = int(sm["smem"])
    starts = [(m.start(), m["name"]) for m in _PTX_ENTRY.finditer(ptx)] + [(len(ptx), "")]
    for (a, name), (b, _) in zip(starts, starts[1:]):
        if lowered.get(name) in infos:
            infos[lowered[name]].ptx = ptx[a:b]
    for name, (mma, loop, inner_mma, inner) in sass.items():
        if lowered.get(name) in infos:
            k = infos[lowered[name]]
            k.sass_mma, k.sass_loop, k.sass_inner_mma, k.sass_inner_loop = mma, loop, inner_mma, inner
    return CompileResult(stem, arch, log, [infos.get(n, KernelInfo(stem, n, arch)) for n in names])


def table(results: list[CompileResult]) -> str:
    rows = {}
    for r in results:
        for k in r.kernels:
            rows.setdefault((k.stem, k.kernel), {})[k.arch] = k
    archs = sorted({r.arch for r in results})
    head = f"{'kernel':<44}" + "".join(f"  regs sm_{a}" for a in archs) + "  smem bytes  spill bytes  stack"
    lines = [head, "-" * len(head)]
    for (stem, kern), per in rows.items():
        spill = max(k.spill_stores + k.spill_loads for k in per.values())
        stack = max(k.stack for k in per.values())
        lines.append(f"{kern:<44}" + "".join(f"  {per[a].registers:>10}" if a in per else "  ---" for a in archs)
                     + f"  {max(k.smem for k in per.values()):>10}  {spill:>11}  {stack:>5}")
    return "\n".join(lines)


IMAGE_NVRTC = "13.0.88"  # nvidia-cuda-nvrtc of the GPU machine's image (cupy-cuda13x 14.2 on CUDA 13.0)


def version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def image_nvrtc_dir() -> Path | None:
    """The lib folder of the image's NVRTC (``$MOQE_NVRTC_IMAGE_LIB``, else ``.venv/nvrtc-<IMAGE_NVRTC>`` as
    .ci/test installs it: ``pip install --target``), or None when it is not there."""
    env = os.environ.get("MOQE_NVRTC_IMAGE_LIB")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / ".venv" / f"nvrtc-{IMAGE_NVRTC}" / "nvidia" / "cu13" / "lib"
    return d if (d / "libnvrtc.so.13").is_file() else None


def compile_with(lib_dir: Path, stems, archs=ARCHS, timeout: float = 900) -> tuple[tuple[int, int], list[CompileResult]]:
    """Compile ``stems`` x ``archs`` with the libnvrtc of ``lib_dir`` (a child process) -> (its version, results)."""
    env = dict(os.environ, LD_PRELOAD=str(lib_dir / "libnvrtc.so.13"),
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, (str(lib_dir), os.environ.get("LD_LIBRARY_PATH")))))
    args = [sys.executable, "-m", "toolkit.gpu.nvrtc", "--json", "--arch", ",".join(map(str, archs)), *stems]
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=Path(__file__).resolve().parents[2])
    if p.returncode != 0:
        raise RuntimeError(f"NVRTC of {lib_dir} failed: {p.stderr.strip()[-2000:]}")
    got = json.loads(p.stdout)
    results = [_from_json(r) for r in got["results"]]
    return tuple(got["version"]), results


def _main(argv=None) -> None:
    import argparse

    from . import CUDA_SOURCES

    ap = argparse.ArgumentParser(prog="python -m toolkit.gpu.nvrtc", description=__doc__.split("\n\n")[0])
    ap.add_argument("stems", nargs="*", help="cuda_src stems (default: every one)")
    ap.add_argument("--arch", default=",".join(map(str, ARCHS)), help="sm architectures, comma-separated")
    ap.add_argument("--json", action="store_true", help="print every kernel's figures and PTX as JSON")
    args = ap.parse_args(argv)
    results = [compile_stem(s, int(a)) for s in args.stems or CUDA_SOURCES for a in args.arch.split(",")]
    if args.json:
        print(json.dumps({"version": version(), "results": [dataclasses.asdict(r) for r in results]}))
    else:
        print(f"NVRTC {'.'.join(map(str, version()))}\n" + table(results))


if __name__ == "__main__":
    _main()
