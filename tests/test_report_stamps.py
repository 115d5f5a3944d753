"""What a benchmark report stamps: its commit, ``-dirty`` when the code differs from it (not
when an earlier report of the same series was just written under ``benchmarks/results/``) with
the diff that made it so, the engine's switches it ran under, and MKL's cap beside the ISA level
PyTorch's and oneDNN's caps give."""

import json
import subprocess

from benchmarks.machine import commit, machine, write_report
from kervan import envs


def git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def test_a_report_written_since_the_commit_leaves_it_clean_and_code_does_not(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    report, code = tmp_path / "benchmarks" / "results" / "a.json", tmp_path / "engine.py"
    report.write_text("{}\n")
    code.write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "start")
    head = commit(tmp_path)
    assert head and not head.endswith("-dirty") and head != "unknown"
    report.write_text('{"rounds": 3}\n')
    assert commit(tmp_path) == head
    code.write_text("x = 2\n")
    assert commit(tmp_path) == head + "-dirty"


def test_the_machine_records_mkls_cap_when_one_is_set(monkeypatch):
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert "mkl_cap" not in machine()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert machine()["mkl_cap"] == "AVX2"


def test_a_dirty_report_carries_its_diff_and_the_engines_switches(tmp_path, monkeypatch):
    code = tmp_path / "engine.py"
    code.write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "start")
    monkeypatch.setenv(envs.KERVAN_HEAP, "system")
    monkeypatch.setenv(envs.KERVAN_API_KEY, "secret")
    write_report({"rounds": 1}, str(tmp_path / "clean.json"), root=tmp_path)
    clean = json.loads((tmp_path / "clean.json").read_text())
    assert "diff" not in clean and clean["environment"] == {envs.KERVAN_HEAP: "system"}  # never a key
    code.write_text("x = 2\n")
    write_report({"rounds": 1}, str(tmp_path / "dirty.json"), root=tmp_path)
    dirty = json.loads((tmp_path / "dirty.json").read_text())
    assert dirty["commit"].endswith("-dirty") and "-x = 1" in dirty["diff"] and "+x = 2" in dirty["diff"]
