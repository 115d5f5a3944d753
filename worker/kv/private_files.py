"""Files only this user may touch: a directory made (or tightened to) 0700 and owned by us,
and files in it opened without following a link, refused when someone else owns them or
can read or write them. For the disk tier, whose file holds prompts' KV and is trusted
when read back, and the key that vouches for it."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)


class UnsafePath(ValueError):
    """A path someone else could read, write or swap."""


def private_directory(path: Path) -> Path:
    """``path`` (made if missing, with its parents) as a directory only we can use."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(f"{path} is not a directory (a link?): give a directory of your own")
    if info.st_uid != os.geteuid():
        raise UnsafePath(f"{path} belongs to uid {info.st_uid}, not this user: give a directory of your own")
    if stat.S_IMODE(info.st_mode) & 0o077:
        log.warning("%s was open to other users (mode %o): made 0700", path, stat.S_IMODE(info.st_mode))
        os.chmod(path, 0o700)
    return path


def open_private(path: Path, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """A descriptor of ``path`` (a regular file, ours, 0600), never through a link."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafePath(f"{path} is a symbolic link: remove it") from None
        raise UnsafePath(f"{path}: {exc}") from None
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):
        why = "is not a regular file"
    elif info.st_uid != os.geteuid():
        why = f"belongs to uid {info.st_uid}, not this user"
    elif stat.S_IMODE(info.st_mode) != 0o600:
        why = f"has mode {stat.S_IMODE(info.st_mode):o}, not 600: others could read or change it"
    if why is not None:
        os.close(fd)
        raise UnsafePath(f"{path} {why}: remove it")
    return fd
