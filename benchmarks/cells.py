"""Cells of the README's generated tables: each number formatted from a committed report,
with its spread, the same way in every table (``benchmarks/tables.py`` assembles them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def reports(benchmark: str) -> Iterator[tuple[str, dict]]:
    """(the report's cell: file and commit, the report) for each committed ``benchmark-*.json``."""
    for path in sorted(RESULTS.glob(f"{benchmark}-*.json")):
        report = json.loads(path.read_text())
        yield f"`{path.name}` ({report['commit']})", report


def ratio(x: dict) -> str:
    """A ratio's median in bold, with the range of the per-round ratios."""
    return f"**{x['median']:.2f}** ({x['min']:.2f}–{x['max']:.2f})"


def middle(values: list[float]) -> str:
    """The median of ``values`` with their range."""
    return f"{sorted(values)[len(values) // 2]:,.1f} ({min(values):,.1f}–{max(values):,.1f})"


def spread(x: dict, fmt: str = "{:,.1f}") -> str:
    """A ``benchmarks.stats.spread`` as median (min–max)."""
    return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}–{fmt.format(x['max'])})"


def maybe(x: dict | None, fmt: str = "{:,.1f}") -> str:
    """``spread``, or a dash where nothing was measured."""
    return "–" if not x or x.get("median") is None or "min" not in x else spread(x, fmt)


def cpu_kind(machine: dict) -> str:
    """The kind of CPU a report ran on, as the README's tables name it: AVX2, AVX-512 + BF16,
    AVX-512 + AMX (an ISA capped with ``ATEN_CPU_CAPABILITY`` reads as the kind it ran as)."""
    if machine.get("isa") == "avx2":
        capped = " (capped)" if machine.get("native_bf16") or machine.get("amx") else ""
        return f"AVX2{capped}, {machine['cpu']}"
    if machine.get("amx"):
        return f"AVX-512 + AMX, {machine['cpu']}"
    return f"AVX-512 + BF16, {machine['cpu']}" if machine.get("native_bf16") else f"AVX-512, {machine['cpu']}"
