"""The README stays short and points at docs/ and CONTRIBUTING.md; every relative link in
them reaches a file (and a heading, where it names one); the README's test command is the
one CI runs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARK_PAGES = [ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks" / "pages").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES + BENCHMARK_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not followed offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_the_readme_is_short_and_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    linked = {Path(t.partition("#")[0]) for t in LINK.findall(readme)}
    assert not {p.relative_to(ROOT) for p in PAGES[1:]} - linked


def test_ci_runs_the_readme_s_two_commands_and_nothing_else():
    """.ci/run runs what .ci/readme_commands.py reads from the README: the main job, then the
    tests, and no command of its own (no system package, no extra tool, no pytest flag)."""
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main_job, tests = module.readme_commands((ROOT / "README.md").read_text())
    assert main_job.startswith("pip install -e '.[pull]' && kervan up --model smollm2-135m --chat --request ")
    assert tests.startswith("pip install -e '.[test]' && python3 -m pytest ")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    own = re.compile(r"(^|[\s;&|(])(python3 -m |)(pytest|apt-get|apt|pip|ruff|mypy|kervan)(\s|$)")
    assert not [line for line in ci if own.search(line)], ci
    assert any("python3 .ci/readme_commands.py" in line for line in ci)
    assert any('bash -euo pipefail -c "$command"' in line for line in ci)


@pytest.mark.parametrize("page", PAGES + BENCHMARK_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_line_is_wider_than_120_characters(page):
    """Outside code blocks; a benchmark page's generated tables (rows from the JSON) excepted."""
    wide, in_code = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and len(line) > 120 and not (page in BENCHMARK_PAGES and line.startswith("|")):
            wide.append(number)
    assert not wide, f"{page.name}: lines {wide}"
