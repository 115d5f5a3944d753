"""Every environment variable Kervan reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path

# where the embedded default model (and later other artefacts) are written
KERVAN_CACHE_DIR = "KERVAN_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(KERVAN_CACHE_DIR) or Path.home() / ".cache" / "kervan")
