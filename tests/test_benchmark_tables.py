"""The benchmark pages' generated tables match the committed JSON they are made from, and the
README (their index) reaches every page and cites only reports that exist."""

import json
import re

from benchmarks import tables


def test_the_pages_tables_are_generated_from_the_committed_json():
    texts = {path.name: path.read_text() for path in tables.documents()}
    assert sum(bool(tables.BLOCK.search(text)) for text in texts.values()) >= 10
    for name, text in texts.items():
        assert tables.render(text) == text, f"{name} is stale: run python -m benchmarks.tables"


def test_the_index_links_every_page_and_its_headlines_cite_reports_that_exist():
    index = tables.README.read_text()
    pages = sorted(tables.PAGES.glob("*.md"))
    assert len(pages) >= 20
    for page in pages:
        assert f"(pages/{page.name})" in index, f"benchmarks/README.md does not link {page.name}"
        assert (tables.HERE / f"{page.stem}.py").is_file(), f"{page.name} names no benchmark"
    headline = index.split("## Headlines", 1)[1].split("\n## ", 1)[0]
    cited = re.findall(r"`([\w.-]+\.json)`", headline)
    assert cited and all((tables.RESULTS / name).is_file() for name in cited), cited


def test_every_engine_report_names_its_commit_machine_and_rounds():
    reports = sorted(tables.RESULTS.glob("engine_throughput-*.json"))
    assert reports
    for path in reports:
        report = json.loads(path.read_text())
        assert report["commit"] and report["machine"]["isa"] and report["workload"]["rounds"] >= 3, path.name
        for by_dtype in report["dtypes"].values():
            assert len(by_dtype["runs"]) == report["workload"]["rounds"]
            for run in by_dtype["runs"]:  # every system did the same work
                assert len({r["output_tokens"] for k, r in run.items() if isinstance(r, dict)}) == 1


def test_every_committed_report_names_its_commit_and_machine_and_is_cited_in_the_readme():
    """No raw report sits unread and none lacks what makes it checkable: the commit it
    measured and the machine (ISA) it ran on."""
    text = "".join(path.read_text() for path in tables.documents())
    reports = sorted(tables.RESULTS.glob("*.json"))
    assert reports
    for path in reports:
        report = json.loads(path.read_text())
        assert report["commit"] and report["machine"]["isa"], path.name
        assert f"`{path.name}`" in text, f"{path.name} is cited by no page of benchmarks/"
    assert not sorted(tables.RESULTS.glob("*.png")), "results/ holds reports (JSON), not pictures of them"


def test_a_tree_of_measures_becomes_one_row_per_measure_in_order(tmp_path, monkeypatch):
    from benchmarks import cells

    report = {"commit": "abc", "summary": {
        "off": {"ttft_ms": {"median": 300.0, "min": 290.0, "max": 320.0, "rounds": [320.0, 300.0, 290.0]},
                "blocks": {"median": 3, "min": 2, "max": 3, "rounds": [3, 2, 3]}},
        "ratio": {"median": 2.5, "min": 2.25, "max": 2.75, "rounds": [2.25, 2.5, 2.75]},
        "note": "not a measure"}}
    (tmp_path / "demo-x.json").write_text(json.dumps(report))
    monkeypatch.setattr(cells, "RESULTS", tmp_path)
    assert tables.measured("demo").splitlines() == [
        "| `demo-x.json` (abc): measure | median (min–max) | every round |", "|---|---|---|",
        "| off · ttft_ms | 300 (290–320) | 320, 300, 290 |",
        "| off · blocks | 3 (2–3) | 3, 2, 3 |",
        "| ratio | 2.500 (2.250–2.750) | 2.250, 2.500, 2.750 |"]
