"""The API's sources lint clean and the committed stubs match them."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_buf_lint_passes():
    buf = shutil.which("buf")
    assert buf, "buf is missing: pip install buf-bin (part of the [test] extra)"
    res = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_generated_stubs_are_up_to_date():
    res = subprocess.run([sys.executable, "protos/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
