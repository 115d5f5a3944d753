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
