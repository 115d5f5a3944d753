"""The benchmarks README's generated tables match the committed JSON they are made from."""

import json

from benchmarks import tables


def test_the_readme_tables_are_generated_from_the_committed_json():
    text = tables.README.read_text()
    assert tables.BLOCK.search(text), "benchmarks/README.md has no generated table"
    assert tables.render(text) == text, "stale: run python -m benchmarks.tables"


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
    text = tables.README.read_text()
    reports = sorted(tables.RESULTS.glob("*.json"))
    assert reports
    for path in reports:
        report = json.loads(path.read_text())
        assert report["commit"] and report["machine"]["isa"], path.name
        assert f"`{path.name}`" in text, f"{path.name} is not cited in benchmarks/README.md"
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
