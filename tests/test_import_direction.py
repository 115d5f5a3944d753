"""Which package may import which (docs/architecture.md, "What may import what"), read from
every module's import statements, deferred ones included:

- ``kervan`` (the shared vocabulary) imports only itself;
- ``worker`` (the engine) imports neither ``services`` nor ``control_plane``;
- a service (``services.<name>``) imports ``services.common``, ``services.proto``, ``kervan`` and,
  the worker service only, ``worker``; no other service and nothing of ``control_plane``;
- ``services.common`` and ``services.proto`` import no service;
- the control plane's long-running services (the planner, the lease watch) import neither the
  CLI nor each other, nor a service's internals (only ``services.common`` and ``services.proto``);
  of the rest of the control plane, only the planner imports ``plan`` and ``tools``;
- the engine's neutral modules (``worker.batch``, ``worker.sequence``, ``worker.noise``) import
  no other part of the engine;
- no product module imports ``tests`` or ``benchmarks``;
- no circle: no module reaches itself through imports, those under ``if TYPE_CHECKING:`` and
  deferred ones included (a package's ``__init__`` counts only where it is named).

A planted import of each kind is caught (the last tests), so the rules cannot pass by reading
nothing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("kervan", "worker", "services", "control_plane")
SHARED_SERVICE_PARTS = {"services.common", "services.proto"}
CONTROL_SERVICES = {"control_plane.planner", "control_plane.lease_watch"}
# the planner sizes pools with ``kervan plan``'s model and reads ``--model`` as the commands do
PLANNER_TOOLS = {"control_plane.planner": {"control_plane.plan", "control_plane.tools"}}
# the engine's seams every part of it imports (a step's plan, a sequence, sampling noise): they import no other
NEUTRAL = {"worker.batch", "worker.sequence", "worker.noise"}


def room(module: str) -> str:
    """The unit a rule speaks of: ``services.router``, ``control_plane.planner``, ``worker``..."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("services", "control_plane") and len(parts) > 1 else parts[0]


def modules(root: Path) -> set[str]:
    out = set()
    for top in PRODUCT:
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def imports(root: Path) -> list[tuple[str, str, str]]:
    """(importing module, imported module, file:line) for every first-party import under ``root``."""
    out = []
    for top in PRODUCT:
        for path in sorted((root / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                where = f"{path.relative_to(root)}:{node.lineno}"
                out += [(module, name, where) for name in names
                        if name.split(".")[0] in (*PRODUCT, "tests", "benchmarks")]
    return out


def why_not(importer: str, imported: str) -> str | None:
    a, b = room(importer), room(imported)
    if b in ("tests", "benchmarks"):
        return "product code never imports tests or benchmarks"
    if a == "kervan" and b != "kervan":
        return "the shared vocabulary imports only itself"
    if a == "worker" and b.split(".")[0] in ("services", "control_plane"):
        return "the engine imports no service and no control plane"
    if a.startswith("services.") and b.startswith("control_plane"):
        return "a service imports nothing of the control plane"
    if a.startswith("services.") and a != "services.worker" and b == "worker":
        return "only the worker service imports the engine"
    if a.startswith("services.") and b.startswith("services.") and a != b and b not in SHARED_SERVICE_PARTS:
        return "a service imports no other service" if a not in SHARED_SERVICE_PARTS else \
            "services.common and services.proto import no service"
    if a in CONTROL_SERVICES and b.startswith("control_plane.") and b != a and b not in PLANNER_TOOLS.get(a, ()):
        return "the planner and the lease watch import neither the CLI nor each other"
    if importer in NEUTRAL and b == "worker" and imported not in NEUTRAL:
        return "the engine's neutral modules import no other part of the engine"
    if a in CONTROL_SERVICES and b.startswith("services.") and b not in SHARED_SERVICE_PARTS:
        return "the planner and the lease watch reach the services through services.common, not their internals"
    return None


def violations(root: Path) -> list[str]:
    return [f"{where}: {a} imports {b}: {why}" for a, b, where in imports(root)
            if (why := why_not(a, b)) is not None]


def circles(root: Path) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's),
    an imported name resolved to the longest module it names (``a.b.C`` -> ``a.b``)."""
    known = modules(root)

    def resolve(name: str) -> str | None:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in known else None

    graph: dict[str, set[str]] = {m: set() for m in known}
    for a, b, _ in imports(root):
        if (target := resolve(b)) is not None and target != a:
            graph[a].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_points_the_allowed_way():
    found = imports(ROOT)
    assert len(found) > 500  # the graph was read
    assert violations(ROOT) == []


def test_no_module_reaches_itself_through_imports():
    assert circles(ROOT) == []


PLANTED = [
    ("worker/runner/bad.py", "from services.router.servicer import RouterServicer", "the engine imports no service"),
    ("worker/bad.py", "import control_plane.cli", "the engine imports no service"),
    ("kervan/bad.py", "from worker.config import EngineConfig", "imports only itself"),
    ("services/router/bad.py", "def f():\n    from services.scheduler.servicer import X", "no other service"),
    ("services/common/bad.py", "from services.router import metrics", "import no service"),
    ("services/worker/bad.py", "from control_plane.cli.launcher import Cluster", "nothing of the control plane"),
    ("control_plane/planner/bad.py", "from control_plane.cli.commands import main", "neither the CLI nor each other"),
    ("control_plane/lease_watch/bad.py", "import control_plane.planner.scaler", "neither the CLI nor each other"),
    ("control_plane/lease_watch/bad.py", "from control_plane.plan.sizing import Sizer", "neither the CLI"),
    ("control_plane/planner/bad.py", "from control_plane.cli.launcher import Cluster", "neither the CLI"),
    ("control_plane/planner/bad.py", "from services.kv_registry.index import P", "not their internals"),
    ("worker/pull_bad.py", "from tests.conftest import make_engine", "never imports tests"),
    ("services/scheduler/bad.py", "import worker.config", "only the worker service imports the engine"),
    ("worker/batch.py", "from worker.kv.kv_cache_manager import KVCacheManager", "neutral modules"),
]


@pytest.mark.parametrize(("path", "code", "words"), PLANTED, ids=[p for p, _, _ in PLANTED])
def test_a_planted_import_against_the_rules_is_caught(tmp_path, path, code, words):
    for top in PRODUCT:
        (tmp_path / top).mkdir()
    planted = tmp_path / path
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text(code + "\n")
    [found] = violations(tmp_path)
    assert found.startswith(f"{path}:") and words in found


def test_a_planted_circle_is_caught(tmp_path):
    for top in PRODUCT:
        (tmp_path / top).mkdir()
    (tmp_path / "worker" / "a.py").write_text("from worker.b import B\n")
    (tmp_path / "worker" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from worker.c import C\n")
    (tmp_path / "worker" / "c.py").write_text("def f():\n    import worker.a\n")
    (tmp_path / "worker" / "d.py").write_text("import worker.a\n")  # outside the circle
    assert circles(tmp_path) == [["worker.a", "worker.b", "worker.c"]]


# docs/architecture.md: "services/common/convert.py turns protobuf into domain objects and back"
DOMAIN_TYPES = {"SamplingParams", "WorkerInfo", "RequestLimits", "Load", "BlockStored", "BlockRemoved",
                "AllBlocksCleared"}
# builds its own WorkerInfo from the engine's numbers (no message read), then hands it to convert.py
BUILDS_ITS_OWN = {"services/worker/membership.py"}


def domain_builders(root: Path) -> list[str]:
    """Modules that import the generated messages and construct a domain object themselves."""
    out = []
    for top in ("services", "control_plane"):
        for path in sorted((root / top).rglob("*.py")):
            if "proto" in path.relative_to(root).parts:
                continue
            tree = ast.parse(path.read_text())
            froms = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
            if not any(n.module == "services.proto" for n in froms):
                continue
            domain = {a.asname or a.name for n in froms if n.module.startswith(("kervan", "services.common.load"))
                      for a in n.names if a.name in DOMAIN_TYPES}
            if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in domain
                   for n in ast.walk(tree)):
                out.append(str(path.relative_to(root)))
    return out


def test_only_convert_py_turns_messages_into_domain_objects(tmp_path):
    assert set(domain_builders(ROOT)) == {"services/common/convert.py", *BUILDS_ITS_OWN}
    (tmp_path / "services" / "router").mkdir(parents=True)
    (tmp_path / "services" / "router" / "bad.py").write_text(
        "from kervan.sampling import SamplingParams\nfrom services.proto import common_pb2\n"
        "def f(m: common_pb2.SamplingParams):\n    return SamplingParams(temperature=m.temperature)\n")
    assert domain_builders(tmp_path) == ["services/router/bad.py"]


def test_the_architecture_doc_names_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted({str(init.parent.relative_to(ROOT)) for top in PRODUCT
                       for init in (ROOT / top).rglob("__init__.py")})
    assert len(packages) > 20
    assert [p for p in packages if f"`{p}/`" not in text] == []
