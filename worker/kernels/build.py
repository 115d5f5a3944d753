"""Building the native CPU kernels, once per (torch, ISA level, compiler, source).

    KERVAN_CACHE_DIR/kernels/<torch>-<isa>-<compiler>-<source hash>/kervan_kernels.so

The library is compiled for an ISA *level* (``-march=x86-64-v3`` for AVX2,
``x86-64-v4`` for AVX-512), never ``-march=native``: a cache or a container image
carried to another CPU of the same level runs, and one of another level looks in
another folder. ATen's ``Vectorized`` is told the same level
(``CPU_CAPABILITY_AVX2``/``_AVX512``), so one source serves every level.

Builds cannot hang or block a later start:
- the compiler writes ``*.tmp<pid>`` and the result is renamed into place, so a
  build killed half-way leaves no library behind, only a temporary file the next
  build removes;
- one builder at a time holds an ``flock`` on ``build.lock``; the kernel releases
  it when its holder dies, however it dies, so a lock is never stale;
- a start waits for another process's build at most ``KERVAN_KERNEL_BUILD_WAIT_S``
  seconds, then gives up (the caller falls back to the PyTorch path and says so).

``kervan build-kernels`` builds ahead of time, for any level, for images; a start
finds such a build whichever compiler made it, so it needs none itself."""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform as _platform
import re
import signal
import subprocess
import time
from pathlib import Path

import torch

from kervan import envs

LIBRARY = "kervan_kernels.so"
SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# no -ffast-math: it licenses the compiler to reassociate sums (a reduction's order would then be
# the compiler's choice, not the source's) and to assume no NaN or Inf (deleting the checks for
# them). The hot paths are written with explicit vectors and did not slow down without it; the
# scalar fallback of decode attention for uncommon head shapes did (about 2x), so the common
# shapes each have a vector path. -fno-math-errno only lets sqrt and exp inline.
COMPILE_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-std=c++20"]
ISA_FLAGS = {
    "avx512": ["-march=x86-64-v4", "-mtune=generic", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "avx2": ["-march=x86-64-v3", "-mtune=generic", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "baseline": ["-DCPU_CAPABILITY=DEFAULT"],  # scalar Vectorized: correct, for any x86-64
    "neon": ["-DCPU_CAPABILITY=DEFAULT"],  # NEON is part of every aarch64 target
    "sve": ["-DCPU_CAPABILITY=DEFAULT"],
}
BUILD_TIMEOUT_S = 600.0
# The sources compile as this many translation units, each a few whole sources (``-include``):
# parsing ATen's headers is ~5 s of every compile, so one unit per source spent half of a build
# on headers (95 s of CPU on the AMX Xeon, 49 s as two units). Two units still use two cores;
# the grouping depends only on the sources, so a name two sources both define fails every build.
UNITS = 2


class KernelBuildError(RuntimeError):
    """The kernels could not be built (no compiler, a compile error, a timeout)."""


class KernelBuildBusy(KernelBuildError):
    """Another process is building the same kernels and did not finish in time."""


def compiler_id(cxx: str | None = None) -> str:
    """``<name><version>-<hash of its --version>``; KernelBuildError without a compiler."""
    cxx = cxx or envs.cxx()
    try:
        version = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()[0]
        banner = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        raise KernelBuildError(f"no working C++ compiler {cxx!r} ({exc}); set CXX") from None
    return f"{Path(cxx).name}{version}-{hashlib.sha256(banner.encode()).hexdigest()[:8]}"


def source_hash() -> str:
    """The sources, headers and compile flags: a build made with other flags is another build."""
    digest = hashlib.sha256(" ".join(COMPILE_FLAGS).encode())
    for src in sorted(SOURCES + HEADERS):
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    return digest.hexdigest()[:12]


def build_key(isa: str, compiler_tag: str) -> str:
    return f"torch{torch.__version__}-{_platform.machine()}-{isa}-{compiler_tag}-{source_hash()}"


def library_path(root: Path, isa: str, compiler_tag: str) -> Path:
    return root / "kernels" / build_key(isa, compiler_tag) / LIBRARY


def find_built(root: Path, isa: str) -> Path | None:
    """A library already built for this torch, ISA level and source, by any compiler:
    an image built ahead of time needs no compiler at run time."""
    found = sorted((root / "kernels").glob(f"{build_key(isa, '*')}/{LIBRARY}"))
    return found[0] if found else None


def ensure_built(root: Path, isa: str, wait_s: float, cxx: str | None = None) -> Path:
    """The library for ``isa`` under ``root``, built now if no process built it before."""
    if isa not in ISA_FLAGS:
        raise KernelBuildError(f"unknown ISA level {isa!r}; one of {', '.join(ISA_FLAGS)}")
    found = find_built(root, isa)
    if found is not None:
        return found
    cxx = cxx or envs.cxx()
    lib = library_path(root, isa, compiler_id(cxx))
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with _BuildLock(lib.parent / "build.lock", wait_s):
        if lib.is_file():  # built by the process we waited for
            return lib
        for stale in lib.parent.glob(f"{LIBRARY}.tmp*"):  # from builds killed half-way
            stale.unlink(missing_ok=True)
        tmp = lib.with_name(f"{LIBRARY}.tmp{os.getpid()}")
        try:
            _compile(cxx, isa, tmp)
            os.replace(tmp, lib)
        finally:
            tmp.unlink(missing_ok=True)
    return lib


def compile_units(sources: list[Path], units: int = UNITS) -> list[list[Path]]:
    """``sources`` in at most ``units`` groups of about equal size (each source weighed with the
    local headers it includes), the heaviest placed first, each into the lightest group."""
    def weight(src: Path) -> int:
        local = re.findall(r'^#include "([^"]+)"', src.read_text(), re.M)
        return src.stat().st_size + sum((src.parent / h).stat().st_size for h in local)

    groups: list[list[Path]] = [[] for _ in range(min(units, len(sources)))]
    loads = [0] * len(groups)
    for src in sorted(sources, key=lambda s: (-weight(s), s.name)):
        lightest = loads.index(min(loads))
        groups[lightest].append(src)
        loads[lightest] += weight(src)
    return [sorted(group) for group in groups]


def compile_commands(cxx: str, isa: str, output: Path) -> tuple[list[list[str]], list[str]]:
    """One compile command per unit of sources (run in parallel), and the link command."""
    from torch.utils import cpp_extension
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    units = compile_units(SOURCES)
    objects = [output.with_name(f"{output.name}.unit{i}.o") for i in range(len(units))]
    compiles = [[cxx, "-c", *COMPILE_FLAGS, *ISA_FLAGS[isa], abi, *includes,
                 *[arg for src in unit[:-1] for arg in ("-include", str(src))], str(unit[-1]), "-o", str(obj)]
                for unit, obj in zip(units, objects)]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    link = [cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(output), *libs]
    return compiles, link


def _compile(cxx: str, isa: str, output: Path) -> None:
    compiles, link = compile_commands(cxx, isa, output)
    try:
        _run_all(compiles)
        _run_all([link])
    finally:
        for obj in output.parent.glob(f"{output.name}.*.o"):
            obj.unlink(missing_ok=True)


def _run_all(commands: list[list[str]]) -> None:
    # each in its own process group, so a timeout kills the compiler's children too
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd in commands]
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    try:
        for cmd, proc in zip(commands, procs):
            try:
                log_text, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise KernelBuildError(f"the kernel build took over {BUILD_TIMEOUT_S:.0f} s and was stopped") from None
            if proc.returncode != 0:
                raise KernelBuildError(f"the kernel build failed ({' '.join(cmd[:3])} ...):\n{log_text[-2000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class _BuildLock:
    """An exclusive ``flock``, polled until ``wait_s`` runs out (KernelBuildBusy)."""

    def __init__(self, path: Path, wait_s: float):
        self.path, self.wait_s = path, wait_s
        self.fd = -1

    def __enter__(self) -> _BuildLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise KernelBuildBusy(f"another process has been building the kernels in {self.path.parent} "
                                          f"for over {self.wait_s:.0f} s") from None
                time.sleep(0.1)
        os.write(self.fd, f"{os.getpid()}\n".encode())  # for a person looking: who builds
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing releases the lock

