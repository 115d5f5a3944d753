"""Print the commands of README.md's "Two commands" section, one per line, in order: the
main job, then the tests. ``.ci/run`` runs exactly these, so CI can never run anything the
README does not tell a user to run."""

from __future__ import annotations

import re
from pathlib import Path

SECTION = "## Two commands"


def readme_commands(readme: str) -> list[str]:
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]
    if len(blocks) != 2 or any("\n" in b for b in blocks):
        raise SystemExit(f"README.md's {SECTION!r} must hold two one-line bash blocks, found {blocks}")
    return blocks


if __name__ == "__main__":
    print("\n".join(readme_commands((Path(__file__).resolve().parents[1] / "README.md").read_text())))
