"""The linter and the type checker pass (their settings are in pyproject.toml): part of the
test suite, so the README's test command is the whole of what CI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_passes():
    res = run("ruff", "check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_passes():
    res = run("mypy")
    assert res.returncode == 0, res.stdout + res.stderr


# what mypy does not yet hold to strict (pyproject.toml) or excepts by error code (a module's first
# line): each may only shrink; lower the number when a module leaves the list
NOT_STRICT_AT_MOST = 89
EXCEPTED_AT_MOST = 30


def test_the_type_checkers_exceptions_only_shrink():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert set(config["files"]) >= {"kervan", "services", "worker", "control_plane"}
    [relaxed] = [o for o in config["overrides"] if o.get("disallow_untyped_defs") is False]
    assert len(relaxed["module"]) <= NOT_STRICT_AT_MOST
    excepted = [path for top in config["files"] for path in (ROOT / top).rglob("*.py")
                if path.read_text().startswith("# mypy: disable-error-code")]
    assert len(excepted) <= EXCEPTED_AT_MOST
