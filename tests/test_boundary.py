"""The package's layering, checked on its source (AST): one module touches distributed's
internals, and no two packages import each other.

Both checks can fail: each has a test feeding it a line that breaks the rule.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import blockflow

PACKAGE = pathlib.Path(blockflow.__file__).parent
BOUNDARY = PACKAGE / "_distributed"

#: distributed modules whose objects are internal (the public API is ``distributed``'s
#: top level, ``distributed.diagnostics``, ``distributed.protocol``, ``distributed.comm``,
#: ``distributed.utils``, ``distributed.security``).
INTERNAL_MODULES = ("distributed.scheduler", "distributed.stealing",
                    "distributed.active_memory_manager", "distributed.worker_state_machine",
                    "distributed.dashboard", "distributed.http", "distributed.core",
                    "distributed.worker", "distributed.nanny")
#: Attribute names that only distributed's internal objects have.
INTERNAL_ATTRS = {
    "handle_worker_status_change", "periodic_callbacks", "extensions", "get_comm_cost",
    "valid_workers", "_get_prefix_duration", "move_task_request", "in_flight",
    "in_flight_occupancy", "worker_restrictions", "loose_restrictions", "host_restrictions",
    "resource_restrictions", "processing_on", "who_has", "has_what", "run_spec",
    "http_application", "stream_handlers", "handlers", "register_worker_plugin",
    "executing_count", "add_plugin",
}
#: Names under which code holds a Scheduler, Worker, WorkerState or TaskState.
INTERNAL_RECEIVERS = {"scheduler", "dask_scheduler", "worker", "dask_worker", "ws", "ts",
                      "dts", "manager", "server"}
#: Public attributes of those objects (the WorkerPlugin / SchedulerPlugin documentation's).
PUBLIC_ATTRS = {"address", "name", "id", "loop", "host"}


def _receiver(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "self":
        return node.attr
    return None


def internal_uses(source: str, filename: str = "<string>") -> list[str]:
    """``"file:line: what"`` for every use of a distributed internal in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(INTERNAL_MODULES):
                out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names
                    if a.name.startswith(INTERNAL_MODULES)]
        elif isinstance(node, ast.Attribute):
            if node.attr in INTERNAL_ATTRS:
                out.append(f"{where}: .{node.attr}")
            elif _receiver(node.value) in INTERNAL_RECEIVERS and node.attr not in PUBLIC_ATTRS:
                out.append(f"{where}: {_receiver(node.value)}.{node.attr}")
        elif isinstance(node, ast.Subscript) and _receiver(node.value) in INTERNAL_RECEIVERS:
            out.append(f"{where}: {_receiver(node.value)}[...]")
    return out


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(BOUNDARY))


def test_only_the_boundary_module_touches_distributed_internals():
    found = [u for p in _modules()
             for u in internal_uses(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert found == [], "distributed internals outside blockflow/_distributed/:\n" + \
        "\n".join(found)


def test_the_boundary_module_is_where_they_are():
    assert len(internal_uses("\n".join(p.read_text() for p in BOUNDARY.rglob("*.py")))) > 30


@pytest.mark.parametrize("line", [
    "scheduler.workers.items()",
    "dask_scheduler.plugins.get('x')",
    "self.scheduler.tasks[key]",
    "ws.processing",
    "ts.worker_restrictions = {addr}",
    "worker.metrics['k'] = f",
    "dask_worker.data.values()",
    "s.extensions.get('stealing')",
    "from distributed.scheduler import WorkerState",
    "import distributed.stealing",
    "self.server.plugins",
])
def test_the_check_catches_internal_uses(line):
    assert internal_uses(line)


@pytest.mark.parametrize("line", [
    "client.scheduler_info()['workers']",
    "from distributed import Client, get_worker, KilledWorker",
    "from distributed.diagnostics.plugin import WorkerPlugin",
    "view.processing + w.executing",
    "worker.address",
])
def test_the_check_lets_public_uses_pass(line):
    assert internal_uses(line) == []


# --- import graph ---------------------------------------------------------------------------


def _node(module: str) -> str | None:
    """The layer a module belongs to: ``blockflow.<subpackage>`` or ``blockflow.<module>``."""
    parts = module.split(".")
    if parts[0] != "blockflow" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def _source_node(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return _node(".".join(rel.parts))


def import_edges(source: str, node: str) -> set[tuple[str, str]]:
    """Edges ``(node, imported layer)`` of every blockflow import in ``source``, including
    imports inside functions."""
    edges = set()
    for n in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(n, ast.Import):
            targets = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            targets = [n.module] if n.module != "blockflow" else \
                [f"blockflow.{a.name}" for a in n.names]
        for t in targets:
            other = _node(t)
            if other is not None and other != node:
                edges.add((node, other))
    return edges


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found, state = [], {}

    def visit(n, stack):
        state[n] = "active"
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "active":
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def file_import_edges(source: str, module: str) -> set[tuple[str, str]]:
    """Edges ``(module, imported module)`` of the blockflow imports ``source`` runs when it is
    imported (module level, outside ``if TYPE_CHECKING``); importing ``a.b.c`` runs
    ``a.b``'s ``__init__`` too, so each parent package is an edge as well."""
    edges = set()

    def targets(n):
        if isinstance(n, ast.Import):
            return [a.name for a in n.names]
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            return [f"{n.module}.{a.name}" if _is_module(f"{n.module}.{a.name}") else n.module
                    for a in n.names]
        return []

    def walk(body):
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                continue
            for t in targets(n):
                parts = t.split(".")
                for i in range(2, len(parts) + 1):
                    other = ".".join(parts[:i])
                    if other.startswith("blockflow.") and other != module and \
                            not module.startswith(other + "."):
                        edges.add((module, other))
            for child in ("body", "orelse", "handlers", "finalbody"):
                walk(getattr(n, child, []) or [])

    walk(ast.parse(source).body)
    return edges


def test_no_import_cycle_between_files():
    """No two files of the package import each other, directly or through others, when
    they are imported (lazy imports inside functions are the way out of a cycle)."""
    edges = set()
    for p in PACKAGE.rglob("*.py"):
        if p == PACKAGE / "__init__.py" or p == PACKAGE / "__main__.py":
            continue  # the facade re-exports everything
        edges |= file_import_edges(p.read_text(), _module_name(p))
    assert cycles(edges) == []


def test_the_file_cycle_check_catches_a_cycle():
    edges = file_import_edges("from blockflow.ml import glm", "blockflow.ml.train") | \
        file_import_edges("import blockflow.ml.train", "blockflow.ml.glm")
    assert cycles(edges) == [["blockflow.ml.glm", "blockflow.ml.train", "blockflow.ml.glm"]]


def test_the_cycle_check_catches_a_cycle():
    edges = import_edges("from blockflow.dashboard import page", "blockflow.scheduling") | \
        import_edges("import blockflow.scheduling.plugin", "blockflow.dashboard")
    assert cycles(edges) == [["blockflow.dashboard", "blockflow.scheduling",
                              "blockflow.dashboard"]]


def test_production_modules_do_not_refer_to_the_test_doubles():
    offenders = []
    for p in _modules():
        if p.is_relative_to(PACKAGE / "testing"):
            continue
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                    [n.module or ""] + [f"{n.module}.{a.name}" for a in n.names]
                if any(x.startswith("blockflow.testing") for x in names):
                    offenders.append(f"{p.name}:{n.lineno}")
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and \
                    "blockflow-simulated-gpu" in n.value:
                offenders.append(f"{p.name}:{n.lineno}")
    assert offenders == []


#: Names in blockflow's namespace that are keys, not objects (click's ``ctx.meta``).
META_KEYS = {"blockflow.output"}


def _resolves(path: str) -> bool:
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_messages_and_docstrings_name_only_blockflow_objects_that_exist():
    import re

    import yaml

    sections = set(yaml.safe_load((PACKAGE / "blockflow.yaml").read_text())["blockflow"])
    pattern = re.compile(r"\bblockflow(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
    missing = set()
    for p in PACKAGE.rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(n, ast.Constant) and isinstance(n.value, str)):
                continue
            for m in pattern.finditer(n.value):
                path = m.group(0).rstrip(".")
                if path.split(".")[1] in sections or n.value[m.end():m.end() + 1] == "-":
                    continue  # a setting (blockflow.cluster.policy, ...hot-high)
                if path.rsplit(".", 1)[1] in ("yaml", "py", "json") or path in META_KEYS:
                    continue  # a file name, a click ctx.meta key
                if not _resolves(path):
                    missing.add(f"{p.name}: {path}")
    assert sorted(missing) == []


# --- the workloads and their test oracles: lazy imports count too ---------------------------

WORKLOADS = PACKAGE / "workloads"
ORACLES = "blockflow.workloads.reference"


def _workload_edges(source: str, module: str) -> set[tuple[str, str]]:
    """Edges ``(module, other workloads file)`` of every import in ``source``, wherever it is:
    module level, inside functions (lazy imports) or under ``if TYPE_CHECKING``. A lazy
    import hides a cycle from :func:`file_import_edges` but not from a reader, and a shim that
    imports the test oracle lazily still puts it on the production path."""
    edges = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
        else:
            continue
        for name in names:
            path = PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py")
            if name.startswith("blockflow.workloads.") and path.parent == WORKLOADS and \
                    path.is_file() and name != module:
                edges.add((module, name))
    return edges


def test_no_import_cycle_between_the_workloads_and_their_oracles_lazy_imports_included():
    """The workloads' files import each other without a cycle even counting the imports
    inside functions, and only tests, notebooks and benchmarks import the oracles
    (``blockflow.workloads.reference``): no workload reaches them, not even through a shim."""
    edges = set()
    for p in WORKLOADS.glob("*.py"):
        if p.name != "__init__.py":
            edges |= _workload_edges(p.read_text(), f"blockflow.workloads.{p.stem}")
    assert cycles(edges) == []
    assert sorted(a for a, b in edges if b == ORACLES) == []


def test_the_workload_cycle_check_sees_a_lazy_import():
    """The circle the ``reference()`` shims made: the oracle imported a workload at module
    level, the workload imported the oracle inside a function."""
    shim = "def reference():\n    from blockflow.workloads.reference import flights_reference\n"
    edges = _workload_edges(shim, "blockflow.workloads.flights") | _workload_edges(
        "from blockflow.workloads.flights import GROUPINGS", ORACLES)
    assert file_import_edges(shim, "blockflow.workloads.flights") == set()  # invisible there
    assert cycles(edges) == [["blockflow.workloads.flights", ORACLES,
                              "blockflow.workloads.flights"]]
