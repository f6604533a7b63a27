"""Run reports: what a computation did on the cluster, from blockflow's scheduler plugin."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from dask.utils import format_bytes

from blockflow.decompose import BlockResize, recorded_resizes
from blockflow.pools.plan import plan, run_cost
from blockflow.pools.pool import Pool
from blockflow.scheduling.actions import Action
from blockflow.scheduling.view import epoch_seconds, plugin_status

__all__ = ["RunReport", "pool_costs", "run_report", "warn_workers_left", "worker_hosts"]


@dataclass
class RunReport:
    """Summary of a computation (see :func:`run_report`).

    Attributes
    ----------
    since : float
        Start of the window, epoch seconds.
    makespan : float
        Seconds from first task start to last task end (0 if none).
    tasks_per_worker : dict of str to int
    moves : int
        Tasks the rebalancer moved.
    bytes_moved : int
        Input bytes of the moved tasks (at most).
    device_memory_peak : dict of str to float or None
        Bytes per worker (None without a GPU).
    policy : str
    tasks : pandas.DataFrame
        ``worker``, ``start``, ``stop`` (seconds since ``since``) per task.
    block_changes : list of BlockResize
        Blocks re-cut in this process (:mod:`blockflow.decompose`).
    pipeline : dict or None
        Latest pipeline pass: ``name``, ``stages``, ``micro_batches``, ``workers``,
        ``makespan`` (s), ``bubble``, ``ideal_bubble`` (0-1), ``timeline``.
    pools : dict or None
        Cost per pool (:func:`pool_costs`).
    """

    since: float
    makespan: float
    tasks_per_worker: dict[str, int]
    moves: int
    bytes_moved: int
    device_memory_peak: dict[str, float | None]
    policy: str
    tasks: pd.DataFrame = field(repr=False)
    block_changes: list[BlockResize] = field(default_factory=list, repr=False)
    pipeline: dict | None = field(default=None, repr=False)
    pools: dict | None = field(default=None, repr=False)

    def to_pandas(self) -> pd.DataFrame:
        """Per-worker table: tasks, busy seconds, device-memory peak (bytes)."""
        busy = (self.tasks.assign(d=self.tasks.stop - self.tasks.start)
                .groupby("worker")["d"].sum())
        workers = sorted(set(self.tasks_per_worker) | set(self.device_memory_peak))
        return pd.DataFrame({
            "worker": workers,
            "tasks": [self.tasks_per_worker.get(w, 0) for w in workers],
            "busy_seconds": [float(busy.get(w, 0.0)) for w in workers],
            "device_memory_peak": pd.array([self.device_memory_peak.get(w) for w in workers],
                                           dtype="Float64"),
        })

    def plot(self):
        """Bokeh figure: tasks finished per worker over time (seconds since the window start)."""
        from bokeh.palettes import Category10_10
        from bokeh.plotting import figure

        fig = figure(title="Tasks finished per worker", x_axis_label="seconds",
                     y_axis_label="tasks", height=300, width=700)
        for i, (worker, df) in enumerate(self.tasks.sort_values("stop").groupby("worker")):
            fig.step(df["stop"].to_numpy(), np.arange(1, len(df) + 1), mode="after",
                     legend_label=worker, color=Category10_10[i % 10], line_width=2)
        fig.legend.location = "top_left"
        return fig

    def __repr__(self) -> str:
        return (f"<blockflow.RunReport: makespan {self.makespan:.2f} s, "
                f"{_count(sum(self.tasks_per_worker.values()), 'task')} on "
                f"{_count(len(self.tasks_per_worker), 'worker')}, "
                f"{_count(self.moves, 'move')} ({format_bytes(self.bytes_moved)}), "
                f"policy {self.policy}>\n" + self.to_pandas().to_string(index=False)
                + "".join(f"\nblocks re-cut: {c.summary()}" for c in self.block_changes)
                + (f"\n{self._pipeline_text()}" if self.pipeline else "")
                + (f"\n{self._cost_text()}" if self.pools else ""))

    def cost_table(self) -> pd.DataFrame:
        """Per-pool table: workers, billed seconds (arrival to retirement, at least the pool's
        ``min_billed``; see :func:`blockflow.pools.plan.run_cost`), busy and idle seconds,
        price ($/h), compute, idle, egress and total cost ($); empty without pools."""
        c = self.pools or {}
        egress = (c.get("egress") or {}).get("by_pool") or {}
        rows = [{"pool": name, **row, "egress_cost": egress.get(name, {}).get("cost", 0.0),
                 "cost": row["cost"] + egress.get(name, {}).get("cost", 0.0)}
                for name, row in sorted(c.get("pools", {}).items())]
        return pd.DataFrame(rows, columns=["pool", "workers", "billed_seconds",
                                           "busy_seconds", "idle_seconds", "price",
                                           "compute_cost", "idle_cost", "egress_cost", "cost"])

    def _cost_text(self) -> str:
        c = self.pools
        bound = c.get("lower_bound") or {}
        goal = c.get("objective") or {}
        lb = (f"; LP lower bound ${bound['cost']:.4g}, makespan {bound['makespan']:.2f} s"
              if bound.get("cost") is not None else "")
        return (f"cost ${c['total_cost']:.4g}: compute ${c['compute_cost']:.4g}, idle "
                f"${c['idle_cost']:.4g}, egress ${c['egress']['cost']:.4g} "
                f"({format_bytes(c['egress']['bytes'])} across providers){lb}; objective "
                f"{goal.get('kind', 'makespan')}"
                + (f" deadline {goal['deadline']:g} s" if goal.get("deadline") else "")
                + (f" budget ${goal['budget']:g}" if goal.get("budget") else "")
                + "\n" + self.cost_table().to_string(index=False))

    def _pipeline_text(self) -> str:
        p = self.pipeline
        return (f"pipeline {p['name']!r}: {p['stages']} stages, {p['micro_batches']} "
                f"micro-batches, {p['makespan']:.2f} s, bubble {p['bubble']:.1%} (GPipe "
                f"(p-1)/(m+p-1) = {p['ideal_bubble']:.1%})")

    def _repr_html_(self) -> str:
        table = self.to_pandas().assign(device_memory_peak=lambda d: [
            "n/a" if pd.isna(v) else format_bytes(v) for v in d.device_memory_peak])
        return (f"<p><b>blockflow run report</b>: makespan {self.makespan:.2f} s, "
                f"{_count(sum(self.tasks_per_worker.values()), 'task')}, "
                f"{_count(self.moves, 'move')} "
                f"({html.escape(format_bytes(self.bytes_moved))}), policy "
                f"{html.escape(self.policy)}</p>" + table.to_html(index=False)
                + self._changes_html()
                + (f"<p>{html.escape(self._pipeline_text())}</p>" if self.pipeline else ""))

    def _changes_html(self) -> str:
        if not self.block_changes:
            return ""
        items = "".join(f"<li>{html.escape(c.summary())}</li>" for c in self.block_changes)
        return f"<p>Blocks re-cut before blockwise stages:</p><ul>{items}</ul>"


def _count(n: int, noun: str) -> str:
    """``"1 move"``, ``"2 moves"``, ``"0 moves"``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def run_report(client, since: float | None = None) -> RunReport:
    """Summarise what ran on the cluster since ``since`` (epoch seconds or a datetime; default
    the current computation's start).

    Returns
    -------
    RunReport

    Raises
    ------
    RuntimeError
        If the scheduler runs no blockflow plugin.
    """
    since = epoch_seconds(since)
    first = plugin_status(client, for_client=client.id)
    changes = recorded_resizes(since, unreported=since is None)
    if since is None:  # this client's latest run (another's may run beside it)
        since = (first.get("client_run") or {}).get("started") or first.get(
            "run_started") or 0.0
    status = plugin_status(client, since=since, task_log=True, for_client=client.id)
    log = pd.DataFrame(status["task_log"], columns=["worker", "start", "stop"])
    log = log[log.start >= since - 1e-3] if len(log) else log
    makespan = float(log.stop.max() - log.start.min()) if len(log) else 0.0
    if len(log):
        log = log.assign(start=log.start - since, stop=log.stop - since)
    moves = [d for d in status["decisions"] if d["action"] == Action.MOVE]
    workers = status["workers"]
    peaks = status["memory_peak"]
    return RunReport(
        since=since,
        makespan=makespan,
        tasks_per_worker={w: int(n) for w, n in log.worker.value_counts().items()}
        if len(log) else {},
        moves=len(moves),
        bytes_moved=int(sum(d.get("seen_input_bytes") or 0 for d in moves)),
        device_memory_peak={w: peaks.get(w) for w in workers},
        policy=status["policy"],
        tasks=log.reset_index(drop=True),
        block_changes=changes,
        pipeline=_pipeline(client, since),
        pools=pool_costs(client, status),
    )


def pool_costs(client, status: dict | None = None) -> dict | None:
    """What the client's latest run (else the current run) cost per pool, beside the LP
    lower bound.

    Parameters
    ----------
    client : distributed.Client
    status : dict, optional
        A :func:`blockflow.plugin_status` already read.

    Returns
    -------
    dict or None
        :func:`blockflow.pools.plan.run_cost` of the run, as the scheduler bills it, plus
        ``objective`` and ``lower_bound`` (:func:`blockflow.pools.plan.plan` over the run's
        work: every worker billed its busy time only, the bound of the same billing); None
        when no worker reports a pool.
    """
    status = status if status is not None else plugin_status(client, for_client=client.id)
    by_pool = status.get("pools") or {}
    if not by_pool or set(by_pool) == {"default"}:
        return None
    mine = status.get("client_run")
    run = mine or status.get("run") or {}
    out = dict((mine or {}).get("run_cost") or status.get("run_cost")
               or run_cost({}, (0.0, 0.0)))
    goal = run.get("objective") or None
    out["objective"] = goal
    work = run.get("group_tasks") or {}
    matrix = status.get("throughput") or {}
    seconds = {g: row for g, row in matrix.items() if g in work}
    known = {g: n for g, n in work.items() if g in seconds}
    out["lower_bound"] = None
    if known:
        names = {name: Pool.from_dict(info) for name, info in by_pool.items()}
        workers = {name: len(info.get("workers", ())) for name, info in by_pool.items()}
        snap = status.get("workers") or {}
        threads = {name: max(int(min((snap.get(a, {}).get("nthreads") or 1)
                                     for a in info["workers"])), 1)
                   for name, info in by_pool.items() if info.get("workers")}
        lb = plan(known, seconds, names, workers, threads=threads,
                  deadline=(goal or {}).get("deadline"), budget=(goal or {}).get("budget"))
        out["lower_bound"] = {"cost": lb.cost if lb.feasible else None,
                              "makespan": lb.makespan if lb.feasible else None,
                              "feasible": lb.feasible, "tasks": lb.tasks}
    return out


def _pipeline(client, since: float) -> dict | None:
    """The latest pipeline pass published in the scheduler's metadata (by
    :class:`blockflow.PipelineParallel`) if it ran after ``since``."""
    meta = client.get_metadata(["blockflow", "pipeline"], default=None)
    if not isinstance(meta, dict) or meta.get("time", 0) < since:
        return None
    return {**meta, "timeline": pd.DataFrame(meta.get("timeline") or {})}


def worker_hosts(client) -> dict[str, str]:
    """Address -> host of each worker the scheduler lists now (``{}`` when it cannot say)."""
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"]
    except Exception:  # the scheduler itself is gone: the job's own error says so
        return {}
    return {a: str(w.get("host") or a) for a, w in workers.items()}


def _retired(client, address: str) -> bool:
    """Whether the scheduler removed worker ``address`` on purpose (retired by adaptive
    scaling or ``retire_workers``, closed by the cluster): its last ``remove-worker`` event
    says ``expected``."""
    try:
        events = client.get_events(address)
    except Exception:  # the scheduler cannot say: name the worker
        return False
    removals = [e for _, e in events if isinstance(e, dict) and e.get("action") == "remove-worker"]
    return bool(removals) and bool(removals[-1].get("expected"))


def warn_workers_left(client, before: dict[str, str], what: str) -> list[str]:
    """One :class:`~blockflow.errors.BlockflowWarning` naming the workers of ``before``
    (:func:`worker_hosts` when ``what`` started) the scheduler no longer lists: they left
    (unreachable, ended) and the run went on without them. Workers retired on purpose
    (adaptive scaling, ``retire_workers``) are not named. Returns their addresses."""
    import warnings

    from blockflow.errors import BlockflowWarning

    now = worker_hosts(client)
    if not now:
        return []
    gone = [a for a in before if a not in now and not _retired(client, a)]
    if gone:
        named = ", ".join(f"{a} (host {before[a]})" for a in gone)
        warnings.warn(f"blockflow: {what}: worker{'s' * (len(gone) > 1)} {named} left during "
                      f"the run (unreachable or ended); the run went on without "
                      f"{'them' if len(gone) > 1 else 'it'}: check that host and its worker.",
                      BlockflowWarning, stacklevel=3)
    return gone
