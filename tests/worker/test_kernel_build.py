"""Native kernel builds that can neither hang nor crash a start: a cache keyed by
ISA level and compiler, a lock that dies with its holder, a bounded wait for
another builder, and a start killed mid-build followed by one that answers."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.kernels import build
from worker.kernels.build import KernelBuildBusy, compile_commands, compiler_id, ensure_built, library_path

# the build for each ISA level: CI runs these again capped to AVX2 (``isa``); the killed-start test
# below only once, its lock and cleanup are the same at every level
isa = pytest.mark.isa


def fake_compile(cxx, isa, output):
    output.write_bytes(b"not really a library")


@isa
def test_the_cache_key_names_torch_the_isa_level_the_compiler_and_the_source(tmp_path):
    paths = {library_path(tmp_path, isa, cc) for isa in ("avx2", "avx512") for cc in ("gcc12", "clang17")}
    assert len(paths) == 4
    key = library_path(tmp_path, "avx2", "gcc12").parent.name
    assert key.startswith("torch2.") and "-avx2-gcc12-" in key and key.endswith(build.source_hash())
    for isa, march in (("avx2", "-march=x86-64-v3"), ("avx512", "-march=x86-64-v4")):
        compiles, link = compile_commands("c++", isa, tmp_path / "out.so")
        assert len(compiles) == build.UNITS < len(build.SOURCES)
        compiled = sorted(arg for cmd in compiles for arg in cmd if arg.endswith(".cpp"))
        assert compiled == sorted(map(str, build.SOURCES))  # every source in one unit, once
        for cmd in compiles:
            assert march in cmd and not any("native" in flag for flag in cmd)  # portable to any CPU of the level
        assert "-shared" in link and link[link.index("-o") + 1] == str(tmp_path / "out.so")


def test_sources_are_grouped_into_units_of_about_equal_weight(tmp_path):
    for name, size in (("a", 900), ("b", 500), ("c", 400), ("d", 100)):
        (tmp_path / f"{name}.cpp").write_text("x" * size)
    (tmp_path / "big.h").write_text("y" * 1000)
    (tmp_path / "d.cpp").write_text('#include "big.h"\n')  # weighed with the header it includes
    units = build.compile_units(sorted(tmp_path.glob("*.cpp")), units=2)
    assert [[p.stem for p in unit] for unit in units] == [["c", "d"], ["a", "b"]]  # 1418 and 1400
    singles = build.compile_units(sorted(tmp_path.glob("*.cpp")), units=8)  # never more units than sources
    assert [[p.stem for p in unit] for unit in singles] == [["d"], ["a"], ["b"], ["c"]]


@isa
def test_the_kernels_keep_the_sources_summation_order_and_ieee_semantics(tmp_path, monkeypatch):
    """No -ffast-math (or its parts that reorder sums or assume no NaN/Inf) in any build: the
    deterministic mode's promise rests on the order the source writes; and flags are part of
    the cache key, so a library built with other flags is never picked up."""
    compiles, _ = compile_commands("c++", "avx512", tmp_path / "out.so")
    unsafe = {"-ffast-math", "-Ofast", "-fassociative-math", "-ffinite-math-only", "-fno-signed-zeros",
              "-freciprocal-math", "-funsafe-math-optimizations"}
    assert not unsafe & {flag for cmd in compiles for flag in cmd}
    before = build.source_hash()
    monkeypatch.setattr(build, "COMPILE_FLAGS", build.COMPILE_FLAGS + ["-ffast-math"])
    assert build.source_hash() != before


@isa
def test_a_library_built_ahead_of_time_is_found_without_a_compiler(tmp_path, monkeypatch):
    """An image built with ``kervan build-kernels`` and run where no compiler is installed."""
    lib = library_path(tmp_path, "avx2", "g++11.4.0-0123abcd")
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"built elsewhere")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert ensure_built(tmp_path, "avx2", wait_s=0) == lib
    with pytest.raises(build.KernelBuildError, match="no working C\\+\\+ compiler"):
        ensure_built(tmp_path, "avx512", wait_s=0)  # another level: not built, and nothing to build it with


@isa
def test_a_lock_left_by_a_killed_builder_blocks_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "_compile", fake_compile)
    lock = library_path(tmp_path, "avx2", compiler_id()).parent / "build.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (lock.parent / "kervan_kernels.so.tmp999.paged_kv.o").write_bytes(b"half a build")
        with pytest.raises(KernelBuildBusy):
            ensure_built(tmp_path, "avx2", wait_s=0.3)
    finally:
        holder.kill()  # dies holding the lock, as a SIGKILLed worker would
        holder.wait()
    started = time.monotonic()
    lib = ensure_built(tmp_path, "avx2", wait_s=5)
    assert time.monotonic() - started < 2
    assert lib.read_bytes() == b"not really a library"
    assert sorted(p.name for p in lib.parent.iterdir()) == ["build.lock", "kervan_kernels.so"]  # leftovers gone


@isa
def test_a_start_waits_for_another_builder_a_bounded_time_then_uses_pytorch_and_says_so(tmp_path):
    from worker.platform import current_platform
    lock = library_path(tmp_path, current_platform().cpu.isa, compiler_id()).parent / "build.lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live builder that does not finish
    try:
        env = {**os.environ, "KERVAN_CACHE_DIR": str(tmp_path), "KERVAN_KERNEL_BUILD_WAIT_S": "1",
               "KERVAN_ATTENTION_BACKEND": "auto"}
        started = time.monotonic()
        res = subprocess.run([sys.executable, "-c", "from worker.kernels import has_native_kernels as h; print(h())"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert time.monotonic() - started < 30
    finally:
        os.close(fd)
    assert res.stdout.strip() == "False", res.stderr
    assert "another process has been building the kernels" in res.stderr
    assert "using the PyTorch path" in res.stderr
    assert not (lock.parent / "kervan_kernels.so").exists()


def _leftover_compilers(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def _is_locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the build's compilers")
def test_a_start_killed_during_the_first_kernel_build_is_followed_by_a_start_that_answers(tmp_path):
    from worker.default_model import ensure_default_model

    env = {**os.environ, "KERVAN_CACHE_DIR": str(tmp_path), "KERVAN_ATTENTION_BACKEND": "native"}
    # the default model as the user's cache holds it: the fresh cache starts without kernels and has nothing
    # else to make first
    cmd = [sys.executable, "-m", "control_plane.cli", "complete", "Once upon a time", "--model",
           str(ensure_default_model()), "--max-tokens", "4", "--temperature", "0", "--json"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        locks: list[Path] = []
        while time.monotonic() < deadline and not (locks and _is_locked(locks[0])):
            assert first.poll() is None, "the first start ended before its kernel build began"
            locks = list(tmp_path.glob("kernels/*/build.lock"))
            time.sleep(0.05)
        assert locks, "no kernel build started"
        time.sleep(1.0)  # the compilers are running now
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    for pid in _leftover_compilers(str(tmp_path)):  # the killed start's orphaned compilers
        os.kill(pid, signal.SIGKILL)
    assert not (locks[0].parent / "kervan_kernels.so").exists()

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    [completion] = json.loads(second.stdout)["completions"]
    assert len(completion["token_ids"]) == 4
    assert sorted(p.name for p in locks[0].parent.iterdir()) == ["build.lock", "kervan_kernels.so"]
