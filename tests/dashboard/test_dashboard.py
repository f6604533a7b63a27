"""blockflow's dashboard: JSON routes over real HTTP, and the page rendered in Chromium."""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request

import dask.array as da
import pytest
from distributed import LocalCluster
from loadaware import wait_until

import blockflow
from blockflow.testing import Tenant, set_tenant, simulated_cluster

ARTIFACTS = os.environ.get("BLOCKFLOW_TEST_ARTIFACTS",
                           os.path.join(os.path.dirname(__file__), os.pardir, "artifacts"))


def _get(url: str):
    with urllib.request.urlopen(url, timeout=20) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def _base(client, prefix: str = "") -> str:
    port = client.cluster.scheduler.http_server.port
    return f"http://127.0.0.1:{port}{prefix}"


@pytest.fixture(scope="module")
def sim():
    """Three simulated GPU workers and one plain CPU worker's worth of metrics: a real
    LocalCluster with blockflow's plugins registered as blockflow.connect does."""
    with simulated_cluster(speeds=[1, 1, 0.5], device_memory="1GiB", processes=False,
                           silence_logs=logging.CRITICAL,
                           dashboard_address="127.0.0.1:0") as client:
        from blockflow.cluster.connection import _register_plugin
        from blockflow.scheduling import Rebalancer

        _register_plugin(client, Rebalancer(policy="dynamic"))
        yield client


def test_json_routes_match_the_scheduler_state(sim):
    x = blockflow.map_blocks(lambda b: b + 1, da.ones(60, chunks=5), name="json").persist()
    assert x.sum().compute() == 120
    status, ctype, body = _get(_base(sim) + "/blockflow/status.json")
    assert status == 200 and ctype.startswith("application/json")
    data = json.loads(body)
    scheduler = sim.cluster.scheduler
    assert data["policy"] == "dynamic"
    assert [w["address"] for w in data["workers"]] == sorted(scheduler.workers)
    plugin = scheduler.plugins["blockflow-rebalancer"]
    for w in data["workers"]:
        ws = scheduler.workers[w["address"]]
        assert w["device"] == "gpu"
        assert w["gpu_memory_total"] == ws.metrics["gpu-memory-total"] == 2**30
        assert w["nthreads"] == ws.nthreads
        assert w["status"] == ws.status.name
        assert w["tasks_total"] == plugin.task_counts[w["address"]]
    assert sum(w["tasks_total"] for w in data["workers"]) >= 12
    assert data["n_decisions"] == len(plugin.decisions)

    status, _, body = _get(_base(sim) + "/blockflow/decisions.json")
    log = json.loads(body)["decisions"]
    assert [(d["action"], d["worker"]) for d in log] == [
        (d["action"], d["worker"]) for d in plugin.decisions]


def test_json_routes_after_a_forced_pause_and_read_only(sim):
    scheduler = sim.cluster.scheduler
    addr = sorted(scheduler.workers)[0]
    since = time.time()
    sim.run(set_tenant, Tenant(0, int(0.95 * 2**30)), workers=[addr])
    sim.run(_heartbeat, workers=[addr])
    plugin = scheduler.plugins["blockflow-rebalancer"]
    sim.sync(_tick, scheduler)
    try:
        _, _, body = _get(_base(sim) + f"/blockflow/decisions.json?since={since}")
        log = json.loads(body)["decisions"]
        assert any(d["action"] == "pause" and d["worker"] == addr for d in log), log
        assert all(isinstance(d["time"], float) and d["time"] > since for d in log)
        # the same instant as an ISO 8601 datetime: the same decisions
        iso = datetime.datetime.fromtimestamp(since, datetime.timezone.utc).isoformat()
        _, _, body = _get(_base(sim) + "/blockflow/decisions.json?since="
                          + urllib.parse.quote(iso))
        assert json.loads(body)["decisions"] == log
        worker = next(w for w in json.loads(_get(_base(sim) + "/blockflow/status.json")[2])
                      ["workers"] if w["address"] == addr)
        assert worker["paused_by_blockflow"] and "device memory" in worker["paused_reason"]
        assert worker["gpu_memory_used"] >= int(0.95 * 2**30)
        with pytest.raises(urllib.error.HTTPError) as e:  # read-only: no POST
            urllib.request.urlopen(urllib.request.Request(
                _base(sim) + "/blockflow/status.json", data=b"{}", method="POST"), timeout=10)
        assert e.value.code == 405
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(_base(sim) + "/blockflow/decisions.json?since=yesterday")
        assert e.value.code == 400
        assert json.loads(e.value.read())["error"] == (
            "since must be seconds since the epoch or an ISO 8601 datetime, limit an "
            "int >= 0")
        with pytest.raises(urllib.error.HTTPError) as e:  # not the whole log
            urllib.request.urlopen(_base(sim) + "/blockflow/decisions.json?limit=-1")
        assert e.value.code == 400
        none = json.loads(_get(_base(sim) + "/blockflow/decisions.json?limit=0")[2])
        assert none["decisions"] == []
    finally:
        sim.run(set_tenant, None, workers=[addr])
        sim.run(_heartbeat, workers=[addr])
        sim.sync(_tick, scheduler)
    assert addr not in plugin.paused


async def _heartbeat(dask_worker):
    await dask_worker.heartbeat()


async def _tick(scheduler):
    scheduler.plugins["blockflow-rebalancer"].run_once()


def test_cpu_workers_show_na_not_zeros():
    client = blockflow.connect(gpu=False, n_workers=2, threads_per_worker=1, processes=False,
                               dashboard_address="127.0.0.1:0")
    try:
        data = json.loads(_get(_base(client) + "/blockflow/status.json")[2])
        for w in data["workers"]:
            assert w["device"] == "cpu"
            assert w["gpu_utilization"] is None and w["gpu_memory_total"] is None
        from blockflow.dashboard.page import BlockflowPage

        page = BlockflowPage(client.cluster.scheduler)
        client.sync(_update, page)
        assert page.workers.data["gpu_util"] == ["n/a", "n/a"]
        assert page.workers.data["device_memory"] == ["n/a", "n/a"]
    finally:
        client.shutdown()
        client.close()


async def _update(page):
    page.update()


def test_page_and_routes_work_under_an_http_prefix():
    with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0",
                      scheduler_kwargs={"http_prefix": "/dask"}) as cluster:
        client = blockflow.connect(cluster.scheduler_address)
        try:
            base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}/dask"
            assert json.loads(_get(base + "/blockflow/status.json")[2])["policy"] == "dynamic"
            status, _, html = _get(base + "/blockflow")
            assert status == 200 and "bokeh" in html.lower()
            _, _, menu = _get(base + "/status")
            assert 'href="blockflow"' in menu or "blockflow" in menu
        finally:
            client.close()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def browser():
    """Headless Chromium through selenium (skips with the reason when not installed)."""
    chromium = _chromium()
    if chromium is None or shutil.which("chromedriver") is None:
        pytest.skip("headless Chromium and chromedriver are not installed "
                    "(.ci/run installs Debian's chromium and chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,1000"):
        opts.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=opts, service=service)
    try:
        yield driver
    finally:
        driver.quit()


# Bokeh 3 draws its tables inside shadow roots: read every DataTable's header and cells.
_READ_TABLES = """
const tables = [];
const walk = (root) => {
  const headers = [...root.querySelectorAll('.slick-header-column')].map(e => e.textContent);
  if (headers.length) {
    const rows = [...root.querySelectorAll('.slick-row')].map(
      r => [...r.querySelectorAll('.slick-cell')].map(c => c.textContent));
    tables.push({headers, rows});
  }
  for (const el of root.querySelectorAll('*')) { if (el.shadowRoot) walk(el.shadowRoot); }
};
walk(document);
return tables;
"""


def _shown_tasks_this_run(driver) -> dict[str, str]:
    """worker address -> the "Tasks (this run)" cell as the browser shows it."""
    for table in driver.execute_script(_READ_TABLES):
        if "Tasks (this run)" in table["headers"] and "Address" in table["headers"]:
            w, t = table["headers"].index("Address"), table["headers"].index("Tasks (this run)")
            return {row[w]: row[t] for row in table["rows"] if len(row) > max(w, t)}
    return {}


def _slow_increment(b):
    time.sleep(0.05)
    return b + 1


@pytest.mark.slow
def test_page_tables_follow_a_running_job_in_headless_chromium(sim, browser):
    """The worker table's cells change while a job runs (BokehJS 3.9 alone kept the first
    values: a DataTable redraws only when its number of rows changes)."""
    browser.get(_base(sim) + "/blockflow")
    wait_until(lambda: _shown_tasks_this_run(browser), timeout=60, interval=0.25,
               message=lambda: "the page to show this run's task counts; tables: "
               f"{[t['headers'] for t in browser.execute_script(_READ_TABLES)]}")
    first = _shown_tasks_this_run(browser)
    assert set(first) == set(sim.cluster.scheduler.workers), first
    # 240 blocks of 50 ms on 3 single-thread workers: about 4 s of work, 8 page updates
    x = blockflow.map_blocks(_slow_increment, da.zeros(240, chunks=1), name="live-table")
    job = sim.compute(x.sum())
    seen = []
    while not job.done():
        seen.append(_shown_tasks_this_run(browser))
        time.sleep(0.3)
    assert job.result() == 240
    run = blockflow.plugin_status(sim)["run"]
    final = {w: str(run["counts"].get(w, 0)) for w in first}
    wait_until(lambda: _shown_tasks_this_run(browser) == final,  # updates every 500 ms
               timeout=30, interval=0.25, message=lambda: (
                   f"the page to show the final counts {final}, not "
                   f"{_shown_tasks_this_run(browser)}"))
    assert _shown_tasks_this_run(browser) == final
    # the cells moved during the job, through values between the start and the end
    between = [s for s in seen if s and s != first and s != final]
    assert between, seen


@pytest.mark.slow
def test_page_renders_in_headless_chromium(sim, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    scheduler = sim.cluster.scheduler
    addr = sorted(scheduler.workers)[-1]
    sim.run(set_tenant, Tenant(95, 0), workers=[addr])  # a hot GPU: forced rebalance
    sim.run(_heartbeat, workers=[addr])
    sim.sync(_tick, scheduler)
    try:
        browser.get(_base(sim) + "/blockflow")

        def rendered(d):
            text = d.find_element(By.TAG_NAME, "body").text
            return all(w in text for w in scheduler.workers) and "pause" in text

        WebDriverWait(browser, 60).until(rendered)
        text = browser.find_element(By.TAG_NAME, "body").text
        for w in scheduler.workers:  # one row per worker
            assert text.count(w) >= 1
        assert "busy with other work" in text  # the decision and its reason
        os.makedirs(ARTIFACTS, exist_ok=True)
        browser.save_screenshot(os.path.join(ARTIFACTS, "blockflow-dashboard.png"))
    finally:
        sim.run(set_tenant, None, workers=[addr])


@pytest.mark.slow
def test_page_groups_workers_by_pool_with_names_history_and_cost(browser):
    """Pools on the page: workers grouped by pool and named, GPU utilisation and device
    memory history plots, cost so far per pool, and decision reasons shown in full."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from blockflow.cluster.connection import _register_plugin
    from blockflow.scheduling import Rebalancer
    from blockflow.pools.pool import Pool

    pools = {Pool("fast", provider="gcp", region="us-east1", price=4.0, speed=4): 1,
             Pool("slow", provider="onprem", price=0.5): 2}
    with simulated_cluster(pools=pools, device_memory="1GiB", processes=False,
                           silence_logs=logging.CRITICAL,
                           dashboard_address="127.0.0.1:0") as client:
        _register_plugin(client, Rebalancer(policy="dynamic"))
        x = blockflow.map_blocks(lambda b: b + 1, da.ones(30, chunks=5), name="pooled")
        assert x.sum().compute() == 60
        status, _, body = _get(_base(client) + "/blockflow/status.json")
        data = json.loads(body)
        assert [(p["name"], p["provider"], p["price"]) for p in data["pools"]] == [
            ("fast", "gcp", 4.0), ("slow", "onprem", 0.5)]
        assert sorted(map(len, (p["workers"] for p in data["pools"]))) == [1, 2]
        assert {w["pool"] for w in data["workers"]} == {"fast", "slow"}
        assert all(p["cost_so_far"] is None or p["cost_so_far"] >= 0 for p in data["pools"])

        hot = sorted(client.cluster.scheduler.workers)[-1]
        client.run(set_tenant, Tenant(95, 0), workers=[hot])  # a hot GPU: a decision
        client.run(_heartbeat, workers=[hot])
        client.sync(_tick, client.cluster.scheduler)
        browser.get(_base(client) + "/blockflow")
        names = {str(w["name"]) for w in data["workers"]}

        def rendered(d):
            text = d.find_element(By.TAG_NAME, "body").text
            return ("Pools" in text and "fast" in text and "slow" in text and "$4/h" in text
                    and "reasons in full" in text)

        try:
            WebDriverWait(browser, 120).until(rendered)
        except Exception:
            raise AssertionError(browser.find_element(By.TAG_NAME, "body").text[:3000])
        tables = browser.execute_script(_READ_TABLES)
        workers = next(t for t in tables if "Pool" in t["headers"] and "Worker" in t["headers"])
        p, w = workers["headers"].index("Pool"), workers["headers"].index("Worker")
        shown = [(r[p], r[w]) for r in workers["rows"] if len(r) > max(p, w)]
        # grouped: the rows of one pool are together, each worker by its name
        assert [pool for pool, _ in shown] == sorted(pool for pool, _ in shown)
        assert {name for _, name in shown} == names
        # the history plots are on the page (Bokeh canvases with these names)
        for name in ("blockflow-gpu-history", "blockflow-memory-history", "blockflow-pools",
                     "blockflow-reasons"):
            assert browser.execute_script(
                "return Bokeh.documents[0].get_model_by_name(arguments[0]) !== null", name)
        text = browser.find_element(By.TAG_NAME, "body").text
        assert "Latest decisions, reasons in full" in text
        reasons = [d["reason"] for d in json.loads(
            _get(_base(client) + "/blockflow/decisions.json")[2])["decisions"]]
        assert any(r in text for r in reasons)  # one whole reason, not cut
        os.makedirs(ARTIFACTS, exist_ok=True)
        browser.save_screenshot(os.path.join(ARTIFACTS, "blockflow-dashboard-pools.png"))


def test_every_action_has_its_own_drawing_and_is_logged_as_its_plain_name():
    """The scheduling vocabulary is closed: every command (Action) has a handler in the
    plugin's actuator, and every logged command and every record (Recorded) has a
    colour/marker/label of its own on the dashboard and reaches the decision log (what
    ``plugin_status``, ``blockflow.decisions()`` and run reports read) as its plain name.
    No record has a handler."""
    import json

    import pandas as pd

    from blockflow.dashboard.page import ACTION_STYLES, ACTIONS, action_style
    from blockflow.scheduling.actions import Action, Decision, Record, Recorded
    from blockflow.scheduling.plugin import Rebalancer

    # reapply and dispatch are not logged (one per pause re-applied, per task sent)
    vocabulary = [a for a in Action if a not in (Action.REAPPLY, Action.DISPATCH)] + list(
        Recorded)
    assert set(ACTION_STYLES) == set(vocabulary)
    styles = [ACTION_STYLES[a] for a in vocabulary]
    assert len({(c, m) for c, m, _ in styles}) == len(vocabulary)  # no two drawn alike
    assert [label for _, _, label in styles] == [a.value for a in vocabulary]
    assert len(set(ACTIONS)) == len(vocabulary)
    assert all(action_style(a.value) == ACTION_STYLES[a] for a in vocabulary)
    assert set(Rebalancer.HANDLERS) == set(Action)
    assert not set(Rebalancer.HANDLERS) & set(Recorded)
    plugin = Rebalancer(policy="off")
    for a in vocabulary:
        entry = (Decision if isinstance(a, Action) else Record)(a, "tcp://w:1", f"because {a}",
                                                                {"x": 1})
        plugin._log(entry)
    logged = plugin.status()["decisions"]
    assert [d["action"] for d in logged] == [a.value for a in vocabulary]
    assert all(type(d["action"]) is str for d in logged)
    json.dumps(logged)  # plain data
    df = pd.DataFrame(logged)  # what blockflow.decisions() builds
    assert list(df.action) == [a.value for a in vocabulary]
    with pytest.raises(ValueError):
        Decision("memory-move", "tcp://w:1", "a record is no command")
    with pytest.raises(ValueError):
        Record("move", "tcp://w:1", "a command is no record")
    with pytest.raises(TypeError):
        plugin.apply(Record("join", "tcp://w:1", "a record never reaches a handler"))
    with pytest.raises(ValueError):
        Decision("teleport", "tcp://w:1", "not an action")
