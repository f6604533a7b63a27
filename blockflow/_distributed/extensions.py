"""What blockflow installs into the scheduler: plugins, handlers, AMM policies, dashboard pages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from distributed.active_memory_manager import ActiveMemoryManagerPolicy, Suggestion
from tornado.ioloop import IOLoop, PeriodicCallback

from blockflow._distributed.checks import serves_bokeh_dashboard
from blockflow._distributed.tasks import HeldResult, held_results
from blockflow._distributed.views import WorkerView, worker_views

__all__ = [
    "AMMPolicy",
    "MemorySuggestion",
    "add_amm_policy",
    "add_dashboard_page",
    "add_handler",
    "add_http_routes",
    "add_periodic_callback",
    "add_scheduler_plugin",
    "http_prefix",
    "is_registered",
    "register_worker_plugin_on_scheduler",
    "remove_periodic_callback",
    "run_amm_policy",
    "scheduler_plugin",
    "style_dashboard_doc",
]

logger = logging.getLogger(__name__)



def add_periodic_callback(scheduler, name: str, fn: Callable[[], Any], interval: float):
    """Run ``fn`` every ``interval`` seconds on the scheduler's loop, registered as ``name``."""
    pc = PeriodicCallback(fn, interval * 1000)
    scheduler.periodic_callbacks[name] = pc
    pc.start()
    return pc


def remove_periodic_callback(scheduler, name: str) -> None:
    """Stop and remove the periodic callback ``name``, if any."""
    pc = scheduler.periodic_callbacks.pop(name, None)
    if pc is not None:
        pc.stop()


def is_registered(scheduler, name: str, plugin) -> bool:
    """Whether ``plugin`` is still the scheduler plugin registered as ``name``
    (``unregister_scheduler_plugin`` removes it without calling its ``close``)."""
    return scheduler.plugins.get(name) is plugin


def add_handler(scheduler, name: str, fn: Callable) -> None:
    """Serve ``fn`` as the scheduler RPC handler ``name`` (read with ``client.scheduler.<name>``)."""
    scheduler.handlers[name] = fn


def scheduler_plugin(scheduler, name: str):
    """The scheduler plugin registered under ``name``, or None."""
    return scheduler.plugins.get(name)


def add_amm_policy(scheduler, policy: Any) -> bool:
    """Install an Active Memory Manager policy; False if the AMM extension is absent."""
    amm = scheduler.extensions.get("amm")
    if amm is None:
        return False
    amm.add_policy(policy)
    return True


@dataclass(frozen=True)
class MemorySuggestion:
    """A plain AMM suggestion: ``op`` ``"replicate"`` (to one of ``candidates``) or ``"drop"``
    (from one of ``candidates``) the result ``key``."""

    op: str
    key: Any
    candidates: frozenset


class AMMPolicy(ActiveMemoryManagerPolicy):
    """Base of blockflow's Active Memory Manager policies: plain data in, plain data out.

    :meth:`plan` yields :class:`MemorySuggestion` objects and is sent the chosen address (None:
    declined); this class turns them into distributed's ``Suggestion`` s."""

    def plan(self, workers: dict[str, WorkerView],
             held: Mapping[str, list[HeldResult]]):  # pragma: no cover - abstract
        raise NotImplementedError
        yield

    def log(self, action: str, worker: str, reason: str, seen: dict, key=None,
            target=None) -> None:
        """Log a decision in the rebalancer's decision log when the rebalancer runs."""
        plugin = scheduler_plugin(self.manager.scheduler, "blockflow-rebalancer")
        if plugin is not None and hasattr(plugin, "log_decision"):
            plugin.log_decision(action, worker, reason, seen, key=key, target=target)

    def run(self):
        scheduler = self.manager.scheduler
        gen = self.plan(worker_views(scheduler), held_results(scheduler))
        try:
            s = next(gen)
            while True:
                ts = scheduler.tasks.get(s.key)
                wss = {scheduler.workers[a] for a in s.candidates if a in scheduler.workers}
                chosen = None
                if ts is not None and wss:
                    choice = yield Suggestion(s.op, ts, wss)
                    chosen = getattr(choice, "address", None)
                s = gen.send(chosen)
        except StopIteration:
            return


# --- dashboard ------------------------------------------------------------------------------


def style_dashboard_doc(doc, component, extra: dict, *, title: str, interval_ms: int) -> None:
    """Make a Bokeh document update (every ``interval_ms``) and look like distributed's pages."""
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    add_periodic_callback(doc, component, interval_ms)
    doc.title = title
    doc.add_root(component.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def add_scheduler_plugin(scheduler, plugin) -> None:
    """Install a scheduler plugin from the scheduler side (``dask scheduler --preload``)."""
    scheduler.add_plugin(plugin)


def http_prefix(scheduler) -> str:
    """The scheduler's HTTP prefix (``"/"`` or ``"/prefix/"``), read off its Bokeh app."""
    app = getattr(scheduler, "http_application", None)
    for sub in getattr(app, "applications", ()):
        prefix = getattr(sub, "prefix", None)
        if isinstance(prefix, str) and "bokeh" in type(sub).__module__ + type(sub).__name__.lower():
            return "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    return "/"


def add_http_routes(scheduler, routes) -> bool:
    """Serve ``routes`` (``[(path, handler, kwargs)]``, handlers get ``dask_server``) from the
    scheduler's HTTP server; False without one."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    prefix = http_prefix(scheduler)
    app.add_handlers(r".*", [(prefix + path.lstrip("/"), cls, {"dask_server": scheduler, **kw})
                             for path, cls, kw in routes])
    return True


def add_dashboard_page(scheduler, path: str, doc_fn, menu_name: str) -> bool:
    """Serve a Bokeh page ``doc_fn(scheduler, extra, doc)`` at ``path`` and list it in the
    "More..." menu. False when the scheduler has no Bokeh dashboard."""
    if not serves_bokeh_dashboard(scheduler):  # checked first: Bokeh is not imported then
        return False
    app = scheduler.http_application
    try:
        from distributed.dashboard import scheduler as dashboard
        from distributed.dashboard.core import BokehApplication
    except ImportError:  # no bokeh
        return False
    prefix = http_prefix(scheduler)
    variables = dashboard.template_variables(scheduler)
    entry = {"url": path.strip("/"), "name": menu_name}
    if entry not in variables["plots"]:
        variables["plots"].append(entry)
    if path in dashboard.applications:  # served by the dashboard's own Bokeh app already
        return True

    bokeh_app = BokehApplication({path: doc_fn}, scheduler, prefix=prefix,
                                 template_variables=variables)
    app.add_application(bokeh_app)
    bokeh_app.initialize(IOLoop.current())  # as distributed's own dashboard does
    return True


# --- worker side (worker plugins, probes run with Client.run) ------------------------------


async def register_worker_plugin_on_scheduler(scheduler, plugin, name: str,
                                              idempotent: bool = False,
                                              timeout: float = 10.0) -> None:
    """Register worker plugin ``plugin`` as ``name`` from the scheduler side, each running
    worker bounded by ``timeout`` seconds (``actions.add_worker_plugin``): a worker that does
    not answer is named in one logged line, one whose ``setup`` fails too."""
    from distributed.protocol.pickle import dumps

    from blockflow._distributed.actions import add_worker_plugin

    errors, failed = await add_worker_plugin(scheduler, dumps(plugin), name, idempotent,
                                             timeout)
    for address, why in failed.items():
        logger.warning("blockflow: worker plugin %s: going on without worker %s (%s); it "
                       "gets the plugin when it registers again", name, address, why)
    for address, reply in errors.items():
        logger.warning("blockflow: worker plugin %s failed on worker %s: %s", name, address,
                       reply.get("exception_text"))


async def run_amm_policy(scheduler, policy, cycles: int = 10,
                         timeout: float = 30.0) -> tuple[int, list]:
    """Run one Active Memory Manager policy alone, now, on a dedicated manager.

    Its copies are made at once: each receiving worker gathers them from their holders
    (``Scheduler.gather_on_worker``, as ``Scheduler.rebalance`` does), where the manager's
    ``acquire-replicas`` would queue them behind every fetch of the work running there (30 s
    while work ran, issue 39). Its drops go through the manager (never the last copy, nor
    one a task running there needs). A cycle waits for its copies, not for the work.

    Parameters
    ----------
    scheduler : distributed.Scheduler
    policy : ActiveMemoryManagerPolicy
    cycles : int, default 10
    timeout : float, default 30.0
        Seconds a cycle waits for its copies; those still landing then land in the
        background and are reported.

    Returns
    -------
    tuple of (int, list)
        Cycles with at least one accepted suggestion (it stops at the first with none), and
        the keys whose copy failed or had not landed within ``timeout``.
    """
    from distributed.active_memory_manager import ActiveMemoryManagerExtension

    amm = ActiveMemoryManagerExtension(scheduler, policies=set(), register=False, start=False)
    accepted: list = []
    copies: dict[str, dict] = {}  # receiving address -> key -> holders' addresses

    def recipient(ts, candidates):
        """The worker that copies ``ts`` now (the manager's checks), or None."""
        if ts.state != "memory" or ts.actor or not ts.who_has:
            return None
        running = scheduler.running
        options = [ws for ws in (candidates or running) if ws in running
                   and ws not in ts.who_has and ts.key not in copies.get(ws.address, ())]
        if not options:
            return None
        ws = min(options, key=lambda w: w.address)
        copies.setdefault(ws.address, {})[ts.key] = [w.address for w in ts.who_has]
        return ws

    class _Recorder(ActiveMemoryManagerPolicy):
        """Passes ``policy``'s drops through, makes its copies; records those accepted."""

        def run(self):
            gen = policy.run()
            ws = None
            while True:
                try:
                    suggestion = gen.send(ws)
                except StopIteration:
                    return
                if suggestion.op == "replicate":
                    ws = recipient(suggestion.ts, suggestion.candidates)
                else:
                    ws = yield suggestion
                if ws is not None:
                    accepted.append(suggestion.op)

    amm.add_policy(_Recorder())
    policy.manager = amm
    done = 0
    missed: list = []
    for _ in range(int(cycles)):
        accepted.clear()
        copies.clear()
        amm.run_once()
        if not accepted:
            break
        done += 1
        if copies:
            gathers = {asyncio.ensure_future(scheduler.gather_on_worker(addr, who_has)): who_has
                       for addr, who_has in copies.items()}
            finished, landing = await asyncio.wait(gathers, timeout=timeout)
            for fut in finished:
                missed.extend(fut.result() if fut.exception() is None else gathers[fut])
            for fut in landing:  # they land in the background; their sources keep theirs
                missed.extend(gathers[fut])
            if landing:
                logger.warning("run_amm_policy: %d copies of %s not landed within %g s",
                               sum(len(gathers[f]) for f in landing), policy, timeout)
    return done, missed
