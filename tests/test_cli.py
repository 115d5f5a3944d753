"""The command line as a user runs it: a fresh cache, no model argument, the
default dtype (``auto``) on whatever CPU this is."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.platform import current_platform, dtype_name


def test_kervan_complete_writes_the_default_model_and_answers(tmp_path):
    env = {**os.environ, "KERVAN_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "control_plane.cli", "complete", "Once upon a time", "--max-tokens", "12",
           "--seed", "3", "--ignore-eos", "--json"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    [completion] = out["completions"]
    assert len(completion["token_ids"]) == 12 and completion["finish_reason"] == "length"
    assert isinstance(completion["text"], str) and completion["text"]
    assert sorted(p.name for p in (tmp_path / "kervan-tiny-llama-v1").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    # a second run reuses the written model and, seeded, says the same thing
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert json.loads(second.stdout)["completions"] == out["completions"]


def test_invalid_option_is_a_clear_error(tmp_path):
    env = {**os.environ, "KERVAN_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "complete", "hi", "--top-p", "0"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "top_p" in res.stderr


@pytest.mark.isa
def test_kervan_up_answers_with_dtype_auto_and_its_workers_log_the_platform():
    """README's main command; its workers name the ISA and the dtype ``auto`` chose."""
    cmd = [sys.executable, "-m", "control_plane.cli", "up", "--request", "Once upon a time", "--port", "0",
           "--max-tokens", "8"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("Once upon a time") and len(res.stdout) > len("Once upon a time")
    assert "[length;" in res.stderr and '"completion_tokens": 8' in res.stderr
    log_dir = Path(re.search(r"logs in (\S+)", res.stderr).group(1))
    platform = current_platform()
    for worker in ("prefill-0", "decode-0"):
        text = (log_dir / f"{worker}.log").read_text()
        assert f"isa {platform.cpu.isa} (torch {platform.cpu.torch_capability}" in text, text[-2000:]
        assert f"engine: {dtype_name(platform.auto_dtype('cpu'))} on cpu, native CPU kernels on" in text


@pytest.mark.isa
def test_kervan_info_reports_what_the_engine_decides():
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "info", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    platform = current_platform()  # this process reads the same ISA caps as the command did
    assert info["cpu"]["isa"] == platform.cpu.isa and info["device"] == "cpu"
    assert info["dtype_auto"] == dtype_name(platform.auto_dtype("cpu"))
    assert info["packed_dtypes"] == platform.describe()["packed_dtypes"]
    assert info["native_kernels"]["library"].endswith("kervan_kernels.so")
    assert f"-{platform.cpu.isa}-" in info["native_kernels"]["library"]


@pytest.mark.isa
def test_kervan_build_kernels_names_the_library_it_built_or_found():
    platform = current_platform()
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "build-kernels"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    isa, path = res.stdout.split()[:2]
    assert isa == f"{platform.cpu.isa}:" and f"-{platform.cpu.isa}-" in path and Path(path).is_file()
    bad = subprocess.run([sys.executable, "-m", "control_plane.cli", "build-kernels", "--isa", "avx9000"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "unknown ISA level 'avx9000'" in bad.stderr


def test_an_unknown_dtype_is_refused_before_anything_starts():
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "up", "--dtype", "int4", "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "choose one of auto, bfloat16, float16, float32" in res.stderr
