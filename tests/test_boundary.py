"""The package's layering, checked on its source (AST): one package touches distributed's
internals, no two files import each other, and pyflakes finds nothing.

Each check can fail: each has a test feeding it lines that break the rule.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import blockflow

#: ast.parse of the sources with the collector paused (conftest.gc_paused).
pytestmark = pytest.mark.usefixtures("gc_paused")

PACKAGE = pathlib.Path(blockflow.__file__).parent
BOUNDARY = PACKAGE / "_distributed"
REPO = PACKAGE.parent

#: distributed modules whose objects are internal (the public API is ``distributed``'s
#: top level, ``distributed.diagnostics``, ``distributed.protocol``, ``distributed.comm``,
#: ``distributed.utils``, ``distributed.security``; the wire framing of
#: ``distributed.protocol.utils`` and the TCP comm are internal).
INTERNAL_MODULES = ("distributed.scheduler", "distributed.stealing",
                    "distributed.active_memory_manager", "distributed.worker_state_machine",
                    "distributed.dashboard", "distributed.http", "distributed.core",
                    "distributed.worker", "distributed.nanny", "distributed.protocol.utils",
                    "distributed.comm.tcp")
#: Public-looking names of distributed that its API documentation does not list (helpers
#: of its own deploy and notebook code).
INTERNAL_NAMES = {"distributed.utils.NoOpAwaitable", "distributed.utils.is_kernel"}
#: Top-level packages whose private (``_name``) objects only the boundary may use.
PRIVATE_ROOTS = ("distributed", "dask")
#: Attribute names that only distributed's internal objects have (flagged on any receiver
#: but a client, where the public ``Client`` methods of the same name pass: ``who_has``).
INTERNAL_ATTRS = {
    "handle_worker_status_change", "periodic_callbacks", "extensions", "get_comm_cost",
    "valid_workers", "_get_prefix_duration", "move_task_request", "in_flight",
    "in_flight_occupancy", "worker_restrictions", "loose_restrictions", "host_restrictions",
    "resource_restrictions", "processing_on", "who_has", "has_what", "run_spec",
    "http_application", "stream_handlers", "handlers", "register_worker_plugin",
    "executing_count", "add_plugin", "unrunnable", "total_resources", "duration_average",
    "coerce_address",
}
#: Names under which code holds a Scheduler, Worker, Nanny, WorkerState or TaskState
#: (unless bound to something else in their scope).
STATE_NAMES = {"scheduler", "dask_scheduler", "worker", "dask_worker", "ws", "ts", "dts",
               "manager", "server", "nanny", "dask_nanny"}
#: Names that may hold a Scheduler (``gen_cluster``'s ``c, s, a, b``) but are common for
#: other things: only the scheduler's own collections are flagged on them.
WEAK_STATE_NAMES = {"s"}
#: The Scheduler's collections and extension points.
SCHEDULER_COLLECTIONS = {"workers", "tasks", "queued", "plugins", "handlers", "extensions",
                         "periodic_callbacks", "unrunnable", "transitions", "stream_handlers"}
#: Public attributes of those objects (the WorkerPlugin / SchedulerPlugin documentation's;
#: ``Worker.get_current_task`` is public API).
PUBLIC_ATTRS = {"address", "name", "id", "loop", "host", "get_current_task"}
#: Methods of a mapping that give its items.
ITEM_VIEWS = {"values", "items", "keys", "copy"}
#: The nodes that open a scope of names.
SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
#: Calls that return a Worker.
WORKER_CALLS = {"get_worker", "current_worker"}
#: Calls that return a Client.
CLIENT_CALLS = {"Client", "get_client", "default_client"}
#: Plugin hooks whose first argument is the Scheduler or Worker (SchedulerPlugin,
#: WorkerPlugin, NannyPlugin; the AMM policy's ``manager`` is an attribute).
HOOKS = {"setup", "teardown", "start", "restart", "update_graph", "add_worker",
         "remove_worker", "add_client", "remove_client", "before_close", "close"}
#: Attributes of state objects whose items are state objects too (iterating them, or
#: indexing them, gives WorkerState or TaskState objects).
STATE_COLLECTIONS = {"workers", "tasks", "processing", "executing", "has_what", "who_has",
                     "dependencies", "dependents", "unrunnable", "queued", "data", "state"}


def _client_api() -> set[str]:
    from distributed import Client, Future

    return {a for a in dir(Client) + dir(Future) if not a.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in PRIVATE_ROOTS


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _last_name(node.func)
    return None


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


class _Checker:
    """One file's uses of distributed internals (see :func:`internal_uses`).

    What a receiver can be is inferred per scope (function, lambda, module): a name is a
    state object where it is a plugin hook's first argument, a parameter with a
    :data:`STATE_NAMES` name, or bound from a state object (``w = get_worker()``,
    ``ws = s.workers[a]``, ``for ts in ws.processing``); a :data:`STATE_NAMES` name bound
    to anything else in its scope is not (``ts = client.get_task_stream()``).
    """

    def __init__(self, tree: ast.AST, filename: str):
        self.tree, self.filename = tree, filename
        self.out: list[str] = []
        self.dd: dict[str, str] = {}  # name bound by an import from distributed/dask -> path
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.bound: dict[ast.AST, dict[str, bool]] = {}  # scope -> name -> holds state
        self.self_state: set[str] = set()  # self.X holding a state object
        self.clients: set[str] = set()
        self.client_api = _client_api()

    def flag(self, node: ast.AST, what: str) -> None:
        self.out.append(f"{self.filename}:{getattr(node, 'lineno', 0)}: {what}")

    # --- scopes ----------------------------------------------------------------------------

    def scope(self, node: ast.AST) -> ast.AST:
        node = self.parents.get(node)
        while node is not None and not isinstance(node, SCOPES):
            node = self.parents.get(node)
        return node if node is not None else self.tree

    def lookup(self, name: str, node: ast.AST) -> bool | None:
        """Whether ``name`` holds a state object where ``node`` reads it (None: unbound)."""
        scope = self.scope(node)
        while True:
            if name in self.bound.get(scope, {}):
                return self.bound[scope][name]
            if scope is self.tree:
                return None
            scope = self.scope(scope)

    # --- what a receiver can be ------------------------------------------------------------

    def is_client(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            return _last_name(node.func) in CLIENT_CALLS
        name = _last_name(node)
        return name is not None and ("client" in name.lower() or name in self.clients)

    def is_state(self, node: ast.AST, weak: bool = False) -> bool:
        """Whether ``node`` can be a Scheduler, Worker, WorkerState or TaskState; with
        ``weak``, also a name that may be one (:data:`WEAK_STATE_NAMES`)."""
        if isinstance(node, ast.Name):
            found = self.lookup(node.id, node)
            if found is None:
                return node.id in STATE_NAMES or (weak and node.id in WEAK_STATE_NAMES)
            return found or (weak and node.id in WEAK_STATE_NAMES
                             and self.param(node.id, node))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            return node.attr in STATE_NAMES or node.attr in self.self_state
        if isinstance(node, ast.Attribute) and node.attr == "scheduler" and \
                _last_name(node.value) == "manager":
            return True  # an AMM policy's self.manager.scheduler
        if isinstance(node, ast.Call):
            return _last_name(node.func) in WORKER_CALLS
        return False

    def param(self, name: str, node: ast.AST) -> bool:
        scope = self.scope(node)
        args = getattr(scope, "args", None)
        return args is not None and name in [a.arg for a in args.args + args.kwonlyargs]

    def is_collection(self, node: ast.AST) -> bool:
        """A collection of state objects: ``s.workers``, ``ws.processing``, ``s.tasks``."""
        if isinstance(node, ast.Attribute):
            if node.attr in SCHEDULER_COLLECTIONS and self.is_state(node.value, weak=True):
                return True
            return node.attr in STATE_COLLECTIONS and self.is_state(node.value)
        return False

    def holds_items(self, node: ast.AST) -> bool:
        """Iterating ``node`` gives state objects (``s.workers.values()``, ``list(...)``)."""
        if self.is_collection(node):
            return True
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and node.func.attr in ITEM_VIEWS:
                return self.is_collection(node.func.value)
            if _last_name(node.func) in ("list", "sorted", "set", "tuple", "reversed") \
                    and node.args:
                return self.holds_items(node.args[0])
        return False

    def is_item(self, node: ast.AST) -> bool:
        """``node`` is a state object: one, or an item of a collection of them."""
        if self.is_state(node):
            return True
        if isinstance(node, ast.Subscript):
            return self.is_collection(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "pop"):
            return self.is_collection(node.func.value)
        return False

    # --- bindings --------------------------------------------------------------------------

    def bind(self, target: ast.AST, holds: bool, at: ast.AST) -> None:
        if isinstance(target, ast.Attribute) and _last_name(target.value) == "self":
            if holds:
                self.self_state.add(target.attr)
            return
        if not isinstance(target, (ast.Name, ast.Tuple, ast.List, ast.Starred)):
            return
        names = self.bound.setdefault(self.scope(at), {})
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                names[n.id] = names.get(n.id, False) or holds

    def bindings(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                self.bind(t, self.is_item(node.value), node)
                if isinstance(node.value, ast.Call) and self.is_client(node.value):
                    self.clients.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            self.bind(node.target, self.is_item(node.value), node)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self.bind(node.target, self.holds_items(node.iter), node)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, self.is_item(item.context_expr), node)

    def parameters(self, node: ast.AST) -> None:
        if not isinstance(node, SCOPES) or isinstance(node, ast.Module):
            return
        names = self.bound.setdefault(node, {})
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        for a in args:
            names[a.arg] = a.arg in STATE_NAMES
        parent = self.parents.get(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in HOOKS \
                and isinstance(parent, ast.ClassDef) and len(node.args.args) > 1 and any(
                    (_last_name(b) or "").endswith(("Plugin", "Policy")) for b in parent.bases):
            names[node.args.args[1].arg] = True  # the Scheduler or Worker of a plugin hook

    # --- the passes ------------------------------------------------------------------------

    def run(self) -> list[str]:
        nodes = list(ast.walk(self.tree))
        for node in nodes:
            self.imports(node)
            self.parameters(node)
        for _ in range(3):  # names bound from names bound from state objects
            for node in nodes:
                self.bindings(node)
        for node in nodes:
            self.check(node)
        return self.out

    def imports(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if _root(a.name):
                    self.dd[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                        a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _root(node.module):
            for a in node.names:
                self.dd[a.asname or a.name] = f"{node.module}.{a.name}"

    def check(self, node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(INTERNAL_MODULES):
                names = ", ".join(a.name for a in node.names)
                self.flag(node, f"from {node.module} import {names} (an internal module)")
            elif _root(node.module) and any(_private(p) for p in node.module.split(".")):
                self.flag(node, f"from {node.module} import ... (a private module)")
            elif _root(node.module):
                for a in node.names:
                    if _private(a.name) or f"{node.module}.{a.name}" in INTERNAL_NAMES:
                        self.flag(node, f"from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(INTERNAL_MODULES) or (
                        _root(a.name) and any(_private(p) for p in a.name.split("."))):
                    self.flag(node, f"import {a.name}")
        elif isinstance(node, ast.ClassDef):
            self.check_overrides(node)
        elif isinstance(node, ast.Attribute):
            self.check_attribute(node)
        elif isinstance(node, ast.Subscript) and self.is_state(node.value):
            self.flag(node, f"{ast.unparse(node.value)}[...]")

    def check_attribute(self, node: ast.Attribute) -> None:
        receiver = node.value
        if _private(node.attr) and _root_name(receiver) in self.dd:
            self.flag(node, f"{ast.unparse(node)} (a private name of "
                            f"{self.dd[_root_name(receiver)]})")
        elif _private(node.attr) and self.is_self(receiver):
            self.check_inherited(node)
        elif _root_name(receiver) in self.dd and ".".join(
                [self.dd[_root_name(receiver)]] + ast.unparse(node).split(".")[1:]) \
                in INTERNAL_NAMES:
            self.flag(node, ast.unparse(node))
        elif node.attr in INTERNAL_ATTRS:
            if not (self.is_client(receiver) and node.attr in self.client_api):
                self.flag(node, f".{node.attr}")
        elif self.is_state(receiver):
            if node.attr not in PUBLIC_ATTRS:
                self.flag(node, f"{ast.unparse(receiver)}.{node.attr}")
        elif node.attr in SCHEDULER_COLLECTIONS and self.is_state(receiver, weak=True):
            self.flag(node, f"{ast.unparse(receiver)}.{node.attr}")

    def is_self(self, node: ast.AST) -> bool:
        """``self`` or ``super()``."""
        return (isinstance(node, ast.Name) and node.id == "self") or (
            isinstance(node, ast.Call) and _last_name(node.func) == "super")

    def check_inherited(self, node: ast.Attribute) -> None:
        """``self._x`` (or ``super()._x``) in a class derived from a distributed/dask class
        whose private name ``_x`` the base class has or uses (``SpecCluster._correct_state``,
        ``Cluster._adaptive``)."""
        klass = self.parents.get(node)
        while klass is not None and not isinstance(klass, ast.ClassDef):
            klass = self.parents.get(klass)
        if klass is None:
            return
        for b in klass.bases:
            if _root_name(b) not in self.dd:
                continue
            base = _resolve(self.dd[_root_name(b)], ast.unparse(b).split(".")[1:])
            if base is None or _knows(base, node.attr):
                self.flag(node, f"{ast.unparse(node)} (a private name of {ast.unparse(b)})")
                return

    def check_overrides(self, node: ast.ClassDef) -> None:
        """A class derived from a distributed/dask class that defines a private method the
        base class has (overriding an internal hook such as ``ProgressBar._draw_bar``)."""
        bases = [b for b in node.bases if _root_name(b) in self.dd]
        methods = [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and _private(f.name)]
        for f in methods:
            for b in bases:
                base = _resolve(self.dd[_root_name(b)], ast.unparse(b).split(".")[1:])
                if base is None or _knows(base, f.name):
                    self.flag(f, f"{node.name}.{f.name} overrides a private method of "
                                 f"{ast.unparse(b)}")
                    break


def _knows(base, name: str) -> bool:
    """Whether distributed's or dask's class ``base`` has or calls the method ``name`` (a
    hook the base class calls without defining it, as ``ProgressBar._draw_bar``)."""
    import inspect
    import re

    if hasattr(base, name):
        return True
    word = re.compile(rf"\b{re.escape(name)}\b")
    for klass in getattr(base, "__mro__", ()):
        if _root(getattr(klass, "__module__", "")):
            try:
                if word.search(inspect.getsource(klass)):
                    return True
            except (OSError, TypeError):
                return True  # no source to tell: take it for a hook
    return False


def _resolve(path: str, attrs: list[str]):
    """The object at ``path`` (a module, or a module's attribute), then ``attrs``; None
    when it cannot be imported."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for a in parts[i:] + attrs:
                obj = getattr(obj, a)
        except AttributeError:
            return None
        return obj
    return None


def internal_uses(source: str, filename: str = "<string>") -> list[str]:
    """``"file:line: what"`` for every use of a distributed internal in ``source``: an import
    of a private (``_name``) object or module of distributed or dask, or of one of
    distributed's internal modules; a private attribute of a distributed/dask module or
    class; an override of a private method of a distributed/dask class; an attribute only
    distributed's internal objects have; any non-public attribute of an object that can be a
    Scheduler, Worker, WorkerState or TaskState (by name, plugin hook argument, ``get_worker()``
    or a binding from such an object's collections)."""
    return _Checker(ast.parse(source, filename), filename).run()


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(BOUNDARY))


def test_only_the_boundary_package_touches_distributed_internals():
    found = [u for p in _modules() + sorted((REPO / "benchmarks").glob("*.py"))
             for u in internal_uses(p.read_text(), str(p.relative_to(REPO)))]
    assert found == [], "distributed internals outside blockflow/_distributed/:\n" + \
        "\n".join(found)


def test_the_boundary_package_is_where_they_are():
    uses = [u for p in BOUNDARY.rglob("*.py") for u in internal_uses(p.read_text(), p.name)]
    assert len(uses) > 30
    # each leak absorbed from the rest of the package is here
    text = "\n".join(uses)
    for what in ("_get_handle", "_parse_cuda_visible_device", "_get_memory_total",
                 "_get_name", "dask._task_spec", "_draw_bar", "distributed.protocol.utils",
                 "_get_prefix_duration", "_worker_cvar"):
        assert what in text, what


#: The internal uses issue 25 lists: four that passed the old check, and one line of each
#: leak then moved into the boundary (devices' NVML helpers, reduction's task-spec alias,
#: the runner's progress-bar override, the handshake's wire framing).
ISSUE_25_USES = [
    "s.workers.items()",
    "from distributed import get_worker\nget_worker().data",
    "from distributed.diagnostics.nvml import _get_handle",
    "from dask._task_spec import Alias",
    "from distributed.diagnostics import nvml\ntotal = nvml._get_memory_total(handle)",
    "import dask._task_spec\nisinstance(node, dask._task_spec.Alias)",
    "from distributed.diagnostics.progressbar import ProgressBar\n"
    "class Feed(ProgressBar):\n"
    "    def _draw_bar(self, remaining, all, **kwargs):\n"
    "        self.draw(all - remaining, all)\n",
    "from distributed.protocol.utils import pack_frames\n"
    "packed = pack_frames(dumps(handshake))",
]


@pytest.mark.parametrize("source", ISSUE_25_USES)
def test_the_check_catches_the_internal_uses_of_issue_25(source):
    assert internal_uses(source)


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
    # receivers known by what they are bound to, whatever their name
    "w = get_worker()\nw.data.values()",
    "import distributed\ndistributed.get_worker().state.tasks",
    "for addr, x in sched.workers.items():\n    pass\nfor a, x in s.workers.items():\n"
    "    x.occupancy",
    "for t in s.tasks.values():\n    t.state",
    "class P(SchedulerPlugin):\n    def start(self, sch):\n        sch.transitions(r, 'x')",
    "class W(WorkerPlugin):\n    def setup(self, w):\n        w.rpc(addr)",
    "class P(SchedulerPlugin):\n    def start(self, scheduler):\n"
    "        self.sched = scheduler\n    def f(self):\n        self.sched.queued",
    "x = s.tasks.get(key)\nx.priority",
    "self.manager.scheduler.tasks",
    "from distributed.worker import thread_state",
    "from distributed.worker import _worker_cvar",
    "from distributed.diagnostics.nvml import _parse_cuda_visible_device",
    "from distributed import diagnostics\ndiagnostics.nvml._get_name(h)",
    "view.who_has",  # not a client: TaskState.who_has
    # a private name of a distributed base class, reached on self (issue 36)
    "from distributed import SpecCluster\nclass C(SpecCluster):\n    def scale(self, n):\n"
    "        self.loop.add_callback(self._correct_state)",
    "import distributed\nclass C(distributed.SpecCluster):\n    def adapt(self):\n"
    "        self._adaptive = None",
    "from distributed.deploy.spec import SpecCluster\nclass C(SpecCluster):\n"
    "    async def f(self):\n        await super()._correct_state()",
    "from distributed.utils import NoOpAwaitable",
    "from distributed.utils import is_kernel\nis_kernel()",
    "import distributed.utils\ndistributed.utils.is_kernel()",
])
def test_the_check_catches_internal_uses(line):
    assert internal_uses(line)


@pytest.mark.parametrize("line", [
    "client.scheduler_info()['workers']",
    "from distributed import Client, get_worker, KilledWorker",
    "from distributed.diagnostics.plugin import WorkerPlugin",
    "view.processing + w.executing",
    "worker.address",
    "client.who_has(futures)",
    "self.client.who_has([f])",
    "client.has_what()",
    "client.register_plugin(plugin)",
    "c = Client(address)\nc.who_has(f)",
    "from distributed import Future\nf = client.submit(inc, 1)\nf.key, Future.key",
    "snap.workers.items()",  # plain data: a policy's snapshot
    "for a, w in snap.workers.items():\n    w.processing",
    "import dask\ndask.__version__",
    "from distributed.diagnostics.progressbar import ProgressBar\n"
    "class Feed(ProgressBar):\n    def _own_helper(self):\n        pass",
    "from distributed.protocol import dumps, loads",
    "class P(WorkerPlugin):\n    def setup(self, worker):\n        worker.address",
    # a subclass's own private names pass
    "from distributed import SpecCluster\nclass C(SpecCluster):\n    def f(self):\n"
    "        self._pool_names = []\n        return self._pool_names",
    "class C:\n    def f(self):\n        return self._correct_state",
])
def test_the_check_lets_public_uses_pass(line):
    assert internal_uses(line) == []


def test_boundary_reexports_every_public_name_sorted():
    from blockflow import _distributed

    names = set()
    for p in sorted(BOUNDARY.glob("*.py")):
        if p.name == "__init__.py":
            continue
        tree = ast.parse(p.read_text())
        module = importlib.import_module(f"blockflow._distributed.{p.stem}")
        assert module.__doc__, p.name
        listed = set(module.__all__)
        defined = {n.name for n in tree.body if isinstance(
            n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not _private(n.name)}
        assert defined <= listed, (p.name, sorted(defined - listed))
        names |= listed
    assert _distributed.__all__ == sorted(_distributed.__all__)
    assert set(_distributed.__all__) == names
    for n in names:
        assert getattr(_distributed, n) is not None


def test_check_worker_runs_in_every_worker_plugin_setup():
    """A worker without the internals the boundary uses fails loudly in each plugin's setup."""
    from blockflow import _distributed
    from blockflow.devices import DeviceMetrics
    from blockflow.scheduling.speculation import SpeculationHandlers

    class NotAWorker:
        address = "tcp://127.0.0.1:1"
        name = "x"

    for plugin in (_distributed.QuietClose(), DeviceMetrics(), SpeculationHandlers()):
        with pytest.raises(_distributed.IncompatibleSchedulerError):
            plugin.setup(NotAWorker())
    with pytest.raises(_distributed.IncompatibleSchedulerError, match="Worker.metrics"):
        _distributed.HandlerPlugin.setup(None, NotAWorker())


# --- pyflakes ---------------------------------------------------------------------------------


def _ruff(*args: str, cwd: pathlib.Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_ruff_reports_a_redefined_function(tmp_path):
    """The project's ruff rules (pyproject.toml) catch a function defined twice, the second
    shadowing the first (F811), as the boundary's ``call_worker`` once was."""
    (tmp_path / "twice.py").write_text(
        "def call_worker(worker, address, name, **msg):\n    return name\n\n\n"
        "def call_worker(worker, address, op, **kwargs):\n    return op\n")
    result = _ruff("--config", str(REPO / "pyproject.toml"), "twice.py", cwd=tmp_path)
    assert result.returncode == 1
    assert "F811" in result.stdout and "call_worker" in result.stdout


def test_the_repository_passes_ruff():
    result = _ruff(".")
    assert result.returncode == 0, result.stdout + result.stderr


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


def test_the_scheduler_side_imports_nothing_from_the_kernel_layer_or_the_dashboard():
    """``blockflow/scheduling/**`` imports nothing from the kernel layer, the AI uses, the
    workloads or the dashboard, lazily inside functions included: shared names live in the
    scheduling vocabulary (blockflow.scheduling.actions) or the boundary package, and the
    dashboard is installed by dotted path from ``blockflow.scheduler.extensions``."""
    import ast
    from pathlib import Path

    import blockflow

    forbidden = ("blockflow.blockwise", "blockflow.reduction", "blockflow.core",
                 "blockflow.dashboard", "blockflow.ml", "blockflow.workloads")
    root = Path(blockflow.__file__).parent / "scheduling"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {name}")
    assert not found, "the scheduler side imports from above it:\n" + "\n".join(found)


#: Boundary functions that act on the scheduler for a scheduling decision: on the scheduler
#: side only the actuator's handler table (``blockflow.scheduling.actuator``) may call them.
SCHEDULER_ACTIONS = frozenset({
    "set_worker_status", "move_task", "restrict_task", "set_task_placement", "hold_tasks",
    "release_tasks", "fail_tasks", "request_backup", "suspend_work_stealing",
    "run_amm_policy",
})
#: Attribute calls that write the decision log (only ``Actuator._log``).
LOG_WRITES = frozenset({"_log"})


def scheduler_actions(source: str, filename: str = "<string>") -> list[str]:
    """``"file:line: what"`` for every call in ``source`` of a boundary function that acts
    on the scheduler (:data:`SCHEDULER_ACTIONS`: ``_distributed.move_task(...)``, under any
    alias of the module or of the function) and every write to a decision log
    (``<x>.decisions.append(...)``, ``<x>._log(...)``)."""
    tree = ast.parse(source, filename)
    modules = {"_distributed"}  # names bound to the boundary package
    functions: dict[str, str] = {}  # local name -> boundary function
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "blockflow" and a.name == "_distributed":
                    modules.add(a.asname or a.name)
                elif node.module.startswith("blockflow._distributed") \
                        and a.name in SCHEDULER_ACTIONS:
                    functions[a.asname or a.name] = a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("blockflow._distributed") and a.asname:
                    modules.add(a.asname)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        where = f"{filename}:{node.lineno}"
        f = node.func
        if isinstance(f, ast.Name) and f.id in functions:
            out.append(f"{where}: {functions[f.id]}()")
        elif isinstance(f, ast.Attribute):
            base = f.value
            name = base.attr if isinstance(base, ast.Attribute) else (
                base.id if isinstance(base, ast.Name) else None)
            if f.attr in SCHEDULER_ACTIONS and name in modules:
                out.append(f"{where}: {name}.{f.attr}()")
            elif f.attr in ("append", "extend", "appendleft") and name == "decisions":
                out.append(f"{where}: decisions.{f.attr}()")
            elif f.attr in LOG_WRITES:
                out.append(f"{where}: {f.attr}()")
    return out


def test_only_the_plugins_handler_table_acts_on_the_scheduler():
    """No module of ``blockflow/scheduling/`` but ``actuator.py`` (whose handler table is the
    one place that acts on the scheduler for a decision and writes the decision log) calls a
    boundary function that acts on the scheduler or writes a decision log: rules, policies
    and the plugin's hooks, tick and close yield commands."""
    root = PACKAGE / "scheduling"
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "actuator.py":
            continue
        found += scheduler_actions(path.read_text(), str(path.relative_to(PACKAGE)))
    assert found == [], "acting on the scheduler outside the handler table:\n" \
        + "\n".join(found)
    # the actuator does call them: the check reads the calls it makes
    assert {u.split(": ")[1] for u in scheduler_actions((root / "actuator.py").read_text())} \
        >= {"_distributed.move_task()", "_distributed.hold_tasks()",
            "_distributed.release_tasks()", "_distributed.set_worker_status()",
            "_distributed.suspend_work_stealing()", "_log()"}


@pytest.mark.parametrize("source", [
    "from blockflow import _distributed\n_distributed.hold_tasks(s, keys)",
    "import blockflow._distributed as bd\nbd.move_task(s, k, a, b)",
    "from blockflow import _distributed as d\nd.set_worker_status(s, a, True, 'x')",
    "from blockflow._distributed import release_tasks as free\nfree(s, keys, 'x')",
    "from blockflow._distributed import fail_tasks\nfail_tasks(s, keys, e, 'x')",
    "import blockflow._distributed\nblockflow._distributed.restrict_task(s, k, a)",
    "self.plugin.decisions.append({'action': 'move'})",
    "plugin._log(decision)",
])
def test_the_handler_table_check_catches_actions_elsewhere(source):
    assert len(scheduler_actions(source)) == 1, scheduler_actions(source)


@pytest.mark.parametrize("source", [
    "from blockflow import _distributed\n_distributed.feeder_tasks(s, keys)",
    "from blockflow import _distributed\n_distributed.worker_views(s)",
    "out.append(Decision('hold', '', 'why', keys=keys))",
    "'_distributed.hold_tasks(s, keys)'",  # text, not a call
])
def test_the_handler_table_check_lets_reads_and_decisions_pass(source):
    assert scheduler_actions(source) == []


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
