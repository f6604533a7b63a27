"""The ``/blockflow`` dashboard page (Bokeh): workers, rebalancer decisions, tasks per worker."""

from __future__ import annotations

import html
import time
from collections import deque

from bokeh.layouts import column, row
from bokeh.models import (
    ColumnDataSource,
    CustomJS,
    DataTable,
    Div,
    FactorRange,
    HoverTool,
    HTMLTemplateFormatter,
    TableColumn,
)
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from dask.utils import format_bytes

from blockflow import _distributed
from blockflow.dashboard.state import dashboard_state
from blockflow.scheduling.actions import Action, Recorded

__all__ = ["ACTION_STYLES", "BlockflowPage", "blockflow_doc"]

#: How each logged command and record is drawn on the decision timeline: (colour, marker,
#: row label). Every :class:`~blockflow.scheduling.actions.Action` but the unlogged
#: ``reapply`` and every :class:`~blockflow.scheduling.actions.Recorded` has its own (a test
#: checks), so none is drawn as another.
ACTION_STYLES: dict[Action | Recorded, tuple[str, str, str]] = {
    Action.PAUSE: ("#d62728", "square", "pause"),
    Action.RESUME: ("#2ca02c", "square", "resume"),
    Recorded.HANDOVER: ("#98df8a", "square_x", "handover"),
    Action.HOLD: ("#ff7f0e", "triangle", "hold"),
    Action.RELEASE: ("#ffbb78", "inverted_triangle", "release"),
    Action.MOVE: ("#1f77b4", "circle", "move"),
    Action.ASSIGN: ("#aec7e8", "diamond", "assign"),
    Action.PLACE: ("#17becf", "diamond", "place"),
    Action.SPECULATE: ("#9467bd", "star", "speculate"),
    Action.RESTRICT: ("#9edae5", "hex", "restrict"),
    Recorded.ADMIT: ("#bcbd22", "hex", "admit"),
    Action.FAIL: ("#8c1a1a", "x", "fail"),
    Action.SUSPEND_STEALING: ("#e377c2", "plus", "suspend-stealing"),
    Action.RESTORE_STEALING: ("#f7b6d2", "plus", "restore-stealing"),
    Recorded.KEEP: ("#7f7f7f", "dash", "keep"),
    Recorded.WAIT: ("#dbdb8d", "asterisk", "wait"),
    Recorded.BACKUP: ("#c5b0d5", "star_dot", "backup"),
    Recorded.MEMORY_MOVE: ("#393b79", "circle_x", "memory-move"),
    Recorded.JOIN: ("#8c564b", "triangle_dot", "join"),
    Recorded.FORGET: ("#c49c94", "inverted_triangle", "forget"),
    Recorded.OBJECTIVE: ("#d6616b", "triangle_pin", "objective"),
    Recorded.SCALE: ("#3182bd", "diamond_cross", "scale"),
    Recorded.DEVICE_TIME: ("#31a354", "square_pin", "device-time"),
    Action.RETIRE: ("#636363", "circle_y", "retire"),
}
#: Rows of the decision timeline, one per action.
ACTIONS = [label for _, _, label in ACTION_STYLES.values()]


def action_style(action: str) -> tuple[str, str, str]:
    """(colour, marker, label) of a logged action (unknown names in grey)."""
    try:
        return ACTION_STYLES[action]
    except KeyError:
        return ("#7f7f7f", "circle", str(action))
WORKER_COLUMNS = [
    ("pool", "Pool"), ("worker", "Worker"), ("address", "Address"), ("device", "Device"), ("gpu_util", "GPU util"),
    ("device_memory", "Device memory used / total"),
    ("device_busy", "Device busy (this run / all)"), ("queued", "Queued"),
    ("processing", "Processing"), ("speed", "Learned speed"),
    ("paused", "Paused by blockflow"), ("tasks_run", "Tasks (this run)"),
]
DECISION_COLUMNS = [("when", "Time"), ("action", "Action"), ("worker", "Worker"),
                    ("target", "Target"), ("reason", "Reason")]


#: A cell showing its whole text on hover (``title``), so a long reason is never cut off.
# (a Bokeh model belongs to one document: each table gets its own formatter, or the page's
# second viewer gets a 500 "Models must be owned by only a single document")
_FULL_TEXT = '<span title="<%- value %>"><%- value %></span>'
#: Seconds of GPU utilisation and device memory history each worker's plot keeps.
HISTORY_SECONDS = 120


def _table(source: ColumnDataSource, columns: list[tuple[str, str]], height: int,
           name: str, full_text: tuple[str, ...] = ()) -> DataTable:
    """A full-width table of ``columns`` ((field, title) pairs) of ``source``."""
    return DataTable(source=source, columns=[
        TableColumn(field=k, title=t, **({"formatter": HTMLTemplateFormatter(template=_FULL_TEXT)}
                                       if k in full_text else {}))
        for k, t in columns],
        index_position=None, sizing_mode="stretch_width", height=height, name=name)


def _na(value, fmt) -> str:
    return "n/a" if value is None else fmt(value)


def _device_busy(w: dict) -> str:
    """"42% / 37%": device seconds over wall seconds in this run and since the worker's
    first heartbeat ("n/a" where unknown, "n/a" alone without device seconds)."""
    run, total = w.get("device_busy"), w.get("device_busy_total")
    if run is None and total is None:
        return "n/a"
    return " / ".join(_na(v, lambda x: f"{x:.0%}") for v in (run, total))


def _redraw_on_new_data(table: DataTable) -> None:
    """Make ``table`` redraw whenever its source's data is replaced (BokehJS 3.x redraws only on
    new ``CDSView`` indices)."""
    table.source.js_on_change("data", CustomJS(args={"table": table},
                                               code="table.view.change.emit()"))


class BlockflowPage:
    """Bokeh component of the page; :meth:`update` refreshes it from the scheduler."""

    def __init__(self, scheduler, **kwargs):
        self.scheduler = scheduler
        self.header = Div(text="", sizing_mode="stretch_width")
        self.workers = ColumnDataSource({k: [] for k, _ in WORKER_COLUMNS})
        self.worker_table = _table(self.workers, WORKER_COLUMNS, 180, "blockflow-workers")
        self.decisions = ColumnDataSource(
            {k: [] for k in ("time", "action", "worker", "target", "reason", "when", "color",
                             "marker")})
        self.decision_table = _table(self.decisions, DECISION_COLUMNS, 220,
                                     "blockflow-decisions", full_text=("reason", "target"))
        # the latest decisions with their reasons in full, wrapped
        self.reasons = Div(text="", sizing_mode="stretch_width", name="blockflow-reasons",
                           styles={"white-space": "normal", "overflow-wrap": "anywhere"})
        # pools: prices, workers by name, cost so far against the bound, the objective
        self.pools = Div(text="", sizing_mode="stretch_width", name="blockflow-pools")
        # each worker's recent GPU utilisation and device memory (kept by this page)
        self.history: dict[str, deque] = {}
        self.history_source = ColumnDataSource(
            {k: [] for k in ("xs", "util", "memory", "worker", "pool", "color")})
        self.util_fig = figure(title="GPU utilisation (%), last 2 min", height=200,
                               sizing_mode="stretch_width", tools="", y_range=(0, 105),
                               x_axis_label="seconds ago", name="blockflow-gpu-history")
        self.memory_fig = figure(title="Device memory used (GiB), last 2 min", height=200,
                                 sizing_mode="stretch_width", tools="",
                                 x_axis_label="seconds ago", name="blockflow-memory-history")
        for fig, field in ((self.util_fig, "util"), (self.memory_fig, "memory")):
            fig.multi_line(xs="xs", ys=field, color="color", line_width=2,
                           source=self.history_source)
            fig.add_tools(HoverTool(tooltips=[("worker", "@worker"), ("pool", "@pool")]))
        self.timeline = figure(
            title="Rebalancer decisions (time, s ago)", height=220,
            y_range=FactorRange(*ACTIONS), sizing_mode="stretch_width",
            tools="xpan,xwheel_zoom,reset", name="blockflow-timeline")
        self.timeline.scatter("ago", "action", source=self.decisions, size=9, alpha=0.7,
                              color="color", marker="marker")
        self.timeline.add_tools(HoverTool(tooltips=[("action", "@action"), ("worker", "@worker"),
                                                    ("reason", "@reason")]))
        self.counts = ColumnDataSource({"worker": [], "tasks": []})
        self.count_fig = figure(title="Tasks per worker, this run", height=220,
                                x_range=FactorRange(), sizing_mode="stretch_width",
                                tools="", name="blockflow-task-counts")
        self.count_fig.vbar(x="worker", top="tasks", width=0.8, source=self.counts)
        self.count_fig.xaxis.major_label_orientation = 0.6
        for table in (self.worker_table, self.decision_table):
            _redraw_on_new_data(table)
        self.tuning = Div(text="", sizing_mode="stretch_width", name="blockflow-tuning")
        # the latest pipeline-parallel pass: one row per stage, a bar per task
        self.pipeline = ColumnDataSource(
            {k: [] for k in ("stage", "start", "stop", "phase", "micro_batch", "worker",
                             "color")})
        self.pipeline_fig = figure(
            title="Pipeline timeline", height=220, y_range=FactorRange(),
            sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset",
            x_axis_label="seconds", name="blockflow-pipeline", visible=False)
        self.pipeline_fig.hbar(y="stage", left="start", right="stop", height=0.7,
                               color="color", source=self.pipeline)
        self.pipeline_fig.add_tools(HoverTool(tooltips=[
            ("phase", "@phase"), ("micro-batch", "@micro_batch"), ("worker", "@worker")]))
        self.root = column(self.header, self.pools, self.worker_table,
                           row(self.util_fig, self.memory_fig, sizing_mode="stretch_width"),
                           self.tuning, self.pipeline_fig,
                           row(self.timeline, self.count_fig,
                                                               sizing_mode="stretch_width"),
                           self.decision_table, self.reasons, sizing_mode="stretch_width",
                           **kwargs)

    def update(self) -> None:
        state = dashboard_state(self.scheduler, max_decisions=200)
        now = state["time"]
        policy = state["policy"] or "not installed"
        about = html.escape(state.get("policy_description") or "")
        run = state["run"]
        run_text = "no run yet" if run is None else (
            f"this run: <b>{html.escape(run['name'])}</b>, started "
            f"{time.strftime('%H:%M:%S', time.localtime(run['started']))}, "
            f"{run['finished']:,} tasks finished of {run['tasks']:,} submitted")
        self.header.text = (f"<h3>blockflow</h3><p>policy: <b>{policy}</b>"
                            f"{f' ({about})' if about else ''} &middot; "
                            f"{len(state['workers'])} workers &middot; "
                            f"{len(state['decisions'])} recent decisions"
                            f"{_backups_text(state.get('speculation'))}</p>"
                            f"<p>{run_text}</p>")
        ws = sorted(state["workers"], key=lambda w: (w["pool"], str(w["name"])))
        self.pools.text = _pools_html(state.get("pools") or [], state.get("objective"), now)
        self._update_history(ws, now)
        self.workers.data = {
            "pool": [w["pool"] for w in ws],
            "worker": [str(w["name"]) for w in ws],
            "address": [w["address"] for w in ws],
            "device": [w["device"] for w in ws],
            "gpu_util": [_na(w["gpu_utilization"], lambda v: f"{v:.0f}%") for w in ws],
            "device_memory": [
                "n/a" if w["gpu_memory_total"] is None else
                f"{_na(w['gpu_memory_used'], format_bytes)} / {format_bytes(w['gpu_memory_total'])}"
                for w in ws],
            "device_busy": [_device_busy(w) for w in ws],
            "queued": [w["queued"] for w in ws],
            "processing": [w["processing"] for w in ws],
            "speed": [_na(w["speed"], lambda v: f"{v:.2f}") for w in ws],
            "paused": [("yes: " + (w["paused_reason"] or "")) if w["paused_by_blockflow"]
                       else "no" for w in ws],
            "tasks_run": [w["tasks_run"] for w in ws],
        }
        ds = state["decisions"][::-1]  # newest first in the table
        styles = [action_style(d["action"]) for d in ds]
        extra = sorted({label for _, _, label in styles} - set(ACTIONS))
        if extra:  # actions this page does not know: a row each, never another's row
            self.timeline.y_range.factors = ACTIONS + extra
        self.decisions.data = {
            "time": [d["time"] for d in ds],
            "ago": [-(now - d["time"]) for d in ds],
            "when": [time.strftime("%H:%M:%S", time.localtime(d["time"])) for d in ds],
            "action": [label for _, _, label in styles],
            "color": [color for color, _, _ in styles],
            "marker": [marker for _, marker, _ in styles],
            "worker": [d["worker"] for d in ds],
            "target": [d.get("target") or "" for d in ds],
            "reason": [d["reason"] for d in ds],
        }
        self.reasons.text = _reasons_html(ds[:20])
        self.tuning.text = _tuning_html(state.get("tuning"), now)
        self._update_pipeline(state.get("pipeline"))
        names = [f"{w['pool']}/{w['name']}" for w in ws]
        self.count_fig.x_range.factors = names
        self.counts.data = {"worker": names, "tasks": [w["tasks_run"] for w in ws]}


    def _update_history(self, ws: list[dict], now: float) -> None:
        """Append each worker's GPU utilisation and device memory; draw the last
        :data:`HISTORY_SECONDS` (workers without GPU metrics draw nothing)."""
        for w in ws:
            h = self.history.setdefault(w["address"], deque())
            h.append((now, w["gpu_utilization"], w["gpu_memory_used"]))
            while h and now - h[0][0] > HISTORY_SECONDS:
                h.popleft()
        for gone in set(self.history) - {w["address"] for w in ws}:
            del self.history[gone]
        shown = [w for w in ws if any(u is not None for _, u, _ in self.history[w["address"]])]
        pools = sorted({w["pool"] for w in ws})
        data = {k: [] for k in ("xs", "util", "memory", "worker", "pool", "color")}
        for i, w in enumerate(shown):
            h = [(t, u, m) for t, u, m in self.history[w["address"]] if u is not None]
            data["xs"].append([t - now for t, _, _ in h])
            data["util"].append([u for _, u, _ in h])
            data["memory"].append([(m or 0) / 2**30 for _, _, m in h])
            data["worker"].append(f"{w['name']} ({w['address']})")
            data["pool"].append(w["pool"])
            data["color"].append(Category10_10[(pools.index(w["pool"]) * 3 + i) % 10])
        self.history_source.data = data

    def _update_pipeline(self, pipe: dict | None) -> None:
        if not pipe or not pipe.get("timeline"):
            return
        t = pipe["timeline"]
        stages = [f"stage {s}" for s in t["stage"]]
        self.pipeline_fig.y_range.factors = sorted(set(stages), reverse=True)
        self.pipeline_fig.title.text = (
            f"Pipeline {pipe['name']}: {pipe['stages']} stages, {pipe['micro_batches']} "
            f"micro-batches, {pipe['makespan']:.2f} s, bubble {pipe['bubble']:.1%} (GPipe "
            f"{pipe['ideal_bubble']:.1%})")
        self.pipeline.data = {
            "stage": stages, "start": list(t["start"]), "stop": list(t["stop"]),
            "phase": list(t["phase"]), "micro_batch": list(t["micro_batch"]),
            "worker": list(t["worker"]),
            "color": ["#1f77b4" if ph == "forward" else "#ff7f0e" for ph in t["phase"]]}
        self.pipeline_fig.visible = True


def _money(v) -> str:
    return "n/a" if v is None else f"${v:,.4f}"


def _pools_html(pools: list[dict], objective: dict | None, now: float) -> str:
    """The pools (workers by name, price, cost so far against the bound) and the run's
    objective with its projected finish, as HTML ("" with one unnamed pool)."""
    if not pools or (len(pools) == 1 and pools[0]["name"] == "default"):
        return ""
    out = ["<h4>Pools</h4>"]
    if objective:
        what = (f"cost, deadline {objective['deadline']:g} s" if objective["kind"] == "cost"
                else f"makespan, budget {_money(objective['budget'])}"
                if objective.get("budget") is not None else "makespan")
        finish = objective.get("projected_finish")
        due = objective.get("deadline_at")
        out.append(
            f"<p class='blockflow-objective'>objective: <b>{html.escape(what)}</b>"
            f" &middot; cost so far {_money(objective.get('cost_so_far'))}"
            f" &middot; LP bound of the work left {_money(objective.get('bound_left'))}"
            + ("" if finish is None else f" &middot; projected finish in "
               f"{max(finish - now, 0):.1f} s")
            + ("" if due is None else f" (deadline in {due - now:.1f} s)") + "</p>")
    rows = "".join(_pool_row(p) for p in pools)
    out.append("<table class='blockflow-pools'><tr><th>pool</th><th>provider</th>"
               "<th>price</th><th>workers</th><th>names</th><th>cost so far</th>"
               "<th>bound (work left)</th></tr>" + rows + "</table>")
    return "".join(out)


def _pool_row(p: dict) -> str:
    where = html.escape(p["provider"]) + (f" / {html.escape(p['region'])}" if p["region"] else "")
    price = "n/a" if p["price"] is None else f"${p['price']:g}/h"
    target = "" if p.get("target") is None else f" (target {p['target']})"
    return (f"<tr><td><b>{html.escape(p['name'])}</b></td><td>{where}</td><td>{price}</td>"
            f"<td>{len(p['workers'])}{target}</td>"
            f"<td style='white-space: normal'>{html.escape(', '.join(p['workers']))}</td>"
            f"<td>{_money(p['cost_so_far'])}</td><td>{_money(p['bound_left'])}</td></tr>")


def _reasons_html(decisions: list[dict]) -> str:
    """The latest decisions with their reasons in full (wrapped, never cut)."""
    if not decisions:
        return ""
    items = "".join(
        f"<li><b>{html.escape(str(d['action']))}</b> {html.escape(str(d['worker'] or ''))}"
        f"{(' &rarr; ' + html.escape(str(d['target']))) if d['target'] else ''}: "
        f"{html.escape(str(d['reason']))}</li>" for d in decisions)
    return f"<h4>Latest decisions, reasons in full</h4><ul>{items}</ul>"


def _config_text(config: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in config.items())


def _tuning_html(tuning: dict | None, now: float) -> str:
    """The running trials of the latest tuner, as an HTML table ("" before any)."""
    if not tuning:
        return ""
    best = tuning.get("best_score")
    head = (f"<h4>Tuning: {html.escape(str(tuning.get('name')))}</h4><p>"
            f"{tuning.get('n_done', 0)} of {tuning.get('n_trials', 0)} trials done, "
            f"{tuning.get('n_failed', 0)} failed, {len(tuning.get('running', []))} running"
            + ("" if best is None else
               f", best score {best:.4g} (trial {tuning.get('best_trial')})")
            + (" &middot; finished" if tuning.get("finished") else "") + "</p>")
    rows = "".join(
        f"<tr><td>{r['trial']}</td><td>{r['rung']}</td><td>{r['epochs']:g}</td>"
        f"<td>{html.escape(str(r['worker']))}</td><td>{max(now - r['since'], 0):.1f} s</td>"
        f"<td>{html.escape(_config_text(r['config']))}</td></tr>"
        for r in sorted(tuning.get("running", []), key=lambda r: (-r["rung"], r["trial"])))
    if not rows:
        return head
    return (head + "<table class='blockflow-trials'><tr><th>trial</th><th>rung</th>"
            "<th>epochs</th><th>worker</th><th>running for</th><th>config</th></tr>"
            + rows + "</table>")


def blockflow_doc(scheduler, extra, doc):
    """Bokeh document function of the ``/blockflow`` page (``(scheduler, extra, doc)``)."""
    page = BlockflowPage(scheduler)
    page.update()
    _distributed.style_dashboard_doc(doc, page, extra, title="Dask: blockflow",
                                     interval_ms=500)


def _backups_text(spec) -> str:
    """Header text on backup copies of stragglers (empty before the first)."""
    if not spec or not spec["launched"]:
        return ""
    return (f" &middot; backup copies: {spec['launched']} started, {spec['won']} won, "
            f"{spec['lost']} lost, {spec['failed']} failed, {spec['running']} running "
            f"({spec['duplicated_seconds']:.1f} s of work done twice)")
