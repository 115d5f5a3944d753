"""The linter and the type checker pass (their settings are in pyproject.toml): part of the
test suite, so the README's test command is the whole of what CI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_passes():
    res = run("ruff", "check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_passes():
    res = run("mypy")
    assert res.returncode == 0, res.stdout + res.stderr
