"""blockflow.tune: asynchronous successive halving with trials as Dask tasks, on real clusters.

The objective is synthetic with a known ordering: a configuration's score at any budget is
``x * b / (b + 1)`` (``b`` the units trained), so the best ``x`` is the best trial at every
rung, and a trial's checkpoint is the units it has trained.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster, get_task_stream
from loadaware import wait_until

from blockflow.scheduling.view import workers_info
from blockflow.testing import simulated_cluster, slowed_to_device_speed
from blockflow.ml.tune import TRIAL_PREFIX, choice, loguniform, sample_configs, tune, uniform

UNIT = 0.02  # seconds one budget unit takes at speed 1


def train(cfg, epochs, checkpoint):
    done = (checkpoint or 0) + epochs
    time.sleep(cfg.get("unit", UNIT) * epochs)
    return cfg["x"] * done / (done + 1), done


def flaky(cfg, epochs, checkpoint):
    if cfg.get("boom"):
        raise ValueError(f"diverged at x={cfg['x']:.3f}")
    return train(cfg, epochs, checkpoint)


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def test_sample_configs_deterministic():
    space = {"lr": loguniform(1e-4, 1e-1), "units": [16, 32, 64], "p": uniform(0, 0.5),
             "act": choice(["relu", "tanh"]), "fixed": 7}
    a, b = sample_configs(space, 20, seed=3), sample_configs(space, 20, seed=3)
    assert a == b
    assert a != sample_configs(space, 20, seed=4)
    assert all(1e-4 <= c["lr"] < 1e-1 and c["units"] in (16, 32, 64) and c["fixed"] == 7
               for c in a)
    assert {c["units"] for c in a} == {16, 32, 64}


def test_asha_promotes_the_best_and_stops_the_worst(client):
    xs = np.random.default_rng(0).permutation(27) / 26  # distinct, known ordering
    configs = [{"x": float(x)} for x in xs]
    r = tune(train, configs, client=client, eta=3, min_budget=1, max_budget=9)
    best = int(np.argmax(xs))
    worst = int(np.argmin(xs))
    assert r.best_trial == best and r.best_config == {"x": 1.0}
    assert math.isclose(r.best_score, 1.0 * 9 / 10)
    t = r.trials
    assert len(t) == 27 and list(t.index) == list(range(27))
    assert t.loc[best, "status"] == "completed" and t.loc[best, "rung"] == 2
    assert t.loc[worst, "status"] == "stopped" and t.loc[worst, "rung"] == 0
    assert set(t["status"]) <= {"completed", "stopped"}
    # ASHA's promotion rule: rung k+1 holds at least floor(|rung k| / eta) trials, each
    # promoted while in the top third of the results its rung had
    h = r.history
    n = h.groupby("rung").size()
    assert n[0] == 27 and n[1] >= 9 and n[2] >= 3
    # the bottom third never leaves rung 0: to be promoted a trial must beat 2/3 of its rung
    bottom = set(np.argsort(xs)[:9].tolist())
    assert not bottom & set(h.loc[h.rung > 0, "trial"])
    # the table is complete: every task has its worker, times and score
    assert (h["status"] == "ok").all() and h["worker"].notna().all()
    assert (h["finished"] >= h["started"]).all() and (h["started"] >= h["submitted"] - 1).all()
    assert t["budget"].max() == 9 and t.loc[best, "duration"] > 0
    assert {"x", "config", "rung", "score", "status", "worker", "started", "finished"} <= \
        set(t.columns)
    assert 0 < r.busy_fraction <= 1 and r.wall_time > 0


def test_synchronous_baseline_keeps_top_third_per_rung(client):
    xs = np.random.default_rng(1).permutation(27) / 26
    configs = [{"x": float(x)} for x in xs]
    r = tune(train, configs, client=client, eta=3, min_budget=1, max_budget=9,
             synchronous=True)
    n = r.history.groupby("rung").size()
    assert list(n) == [27, 9, 3]
    top3 = set(np.argsort(xs)[-3:].tolist())
    assert set(r.history.loc[r.history.rung == 2, "trial"]) == top3
    assert r.best_trial == int(np.argmax(xs))


def test_certain_promotions_are_synchronous_sh_and_speculation_only_fills_idle_threads(
        client):
    """blockflow's promotion order: a promotion not marked speculative is one synchronous SH
    makes too, and ASHA's speculative promotions start only once no configuration is left
    to start (they fill threads that would idle); none is run twice."""
    xs = np.random.default_rng(5).permutation(81) / 80
    configs = [{"x": float(x), "unit": 0.005} for x in xs]
    asha = tune(train, configs, client=client, eta=3, min_budget=1, max_budget=9)
    sync = tune(train, configs, client=client, eta=3, min_budget=1, max_budget=9,
                synchronous=True)
    h, hs = asha.history, sync.history
    assert asha.best_trial == sync.best_trial == int(np.argmax(xs))
    for rung in (1, 2):
        sh = set(hs.loc[hs.rung == rung, "trial"])
        here = h[h.rung == rung]
        assert set(here.loc[~here.speculative, "trial"]) <= sh, rung
        # every trial SH takes to this rung gets there, once (certain or speculative)
        assert sh <= set(here.trial) and not here.trial.duplicated().any(), rung
    assert not h.loc[h.rung == 0, "speculative"].any()
    last_new = h.loc[h.rung == 0, "submitted"].max()
    assert (h.loc[h.speculative, "submitted"] >= last_new).all()
    # far less work beyond SH's than ASHA's rule alone gives (about 20 % more epochs)
    assert h.epochs.sum() <= 1.15 * hs.epochs.sum(), (h.epochs.sum(), hs.epochs.sum())


def test_li_et_al_order_speculates_before_the_last_configuration_starts(client):
    """promotion="asha" (or the setting blockflow.tune.promotion): Li et al.'s order, any
    promotion before a new configuration, so some speculative promotions start while
    configurations are still waiting; a bad value is refused, naming the setting."""
    import dask

    xs = np.random.default_rng(6).permutation(81) / 80
    configs = [{"x": float(x), "unit": 0.005} for x in xs]
    with dask.config.set({"blockflow.tune.promotion": "asha"}):
        r = tune(train, configs, client=client, eta=3, min_budget=1, max_budget=9)
    h = r.history
    assert r.best_trial == int(np.argmax(xs))
    last_new = h.loc[h.rung == 0, "submitted"].max()
    assert (h.speculative & (h.submitted < last_new)).any()
    with pytest.raises(ValueError, match="blockflow.tune.promotion"):
        tune(train, configs, client=client, promotion="eager")


def test_failed_trial_is_recorded_and_the_run_goes_on(client):
    xs = np.random.default_rng(2).permutation(27) / 26
    configs = [{"x": float(x), "boom": i in (3, 11)} for i, x in enumerate(xs)]
    r = tune(flaky, configs, client=client, eta=3, min_budget=1, max_budget=9)
    t = r.trials
    assert list(t.index[t.status == "failed"]) == [3, 11]
    assert t.loc[3, "error"] == f"ValueError: diverged at x={xs[3]:.3f}"
    assert math.isnan(t.loc[3, "score"]) and t.loc[3, "worker"] is not None
    failed = r.history[r.history.status == "failed"]
    assert sorted(failed.trial) == [3, 11]
    ok = [i for i in range(27) if i not in (3, 11)]
    assert r.best_trial == max(ok, key=lambda i: xs[i])
    assert (t.drop([3, 11]).status.isin(["completed", "stopped"])).all()


def _rows(stream):
    rows = []
    for s in stream:
        if not str(s["key"]).startswith(TRIAL_PREFIX):
            continue
        for ss in s["startstops"]:
            if ss["action"] == "compute":
                rows.append((s["worker"], ss["start"], ss["stop"]))
    return rows


def _task_rows(stream):
    """Per worker, its trial tasks' (start, stop) in order (one thread each)."""
    out: dict = {}
    for w, start, stop in sorted(_rows(stream), key=lambda r: r[1]):
        out.setdefault(w, []).append((start, stop))
    return out


@pytest.mark.slow
def test_promotions_go_to_fastest_free_worker_and_no_worker_idles():
    """By the order of events, not their timing (how busy each worker was is measured in
    benchmarks/tuning.py): every trial task went to the fastest free worker as the tuner
    saw them; none was queued behind a worker's running trial; and a worker whose trial
    the tuner took in while configurations waited got its next one in the next dispatch."""
    speeds = (1.0, 0.5, 0.25)
    xs = np.random.default_rng(4).permutation(27) / 26
    configs = [{"x": float(x), "unit": 0.25} for x in xs]
    with simulated_cluster(speeds=speeds, processes=False) as client:
        workers = sorted(workers_info(client))
        with get_task_stream(client) as ts:
            r = tune(slowed_to_device_speed(train), configs, client=client, eta=3,
                     min_budget=1, max_budget=9)
        stream = ts.data
    h = r.history
    assert r.best_trial == int(np.argmax(xs))
    assert not h.backup.any()  # every speed is declared: no blind worker, no copies
    # each trial task, promotions and new configurations, went to the fastest free worker
    assert (h["speed"] >= h["fastest_free"] - 1e-9).all(), h
    # none waited in a worker's queue: each was submitted after the worker's last one ended
    tasks = _task_rows(stream)
    assert sum(map(len, tasks.values())) == len(h)
    for w in workers:
        subs = sorted(h.loc[h.worker == w, "submitted"])
        assert len(subs) == len(tasks.get(w, ())), w
        for s, (_, stop) in zip(subs[1:], tasks[w]):
            assert s >= stop, (w, s, stop)
    # no worker idles while a configuration waits: the tuner takes results in, then
    # dispatches; a worker whose trial it took in while at least one configuration per
    # worker was still to start got its next trial in the dispatch that followed (no
    # submission followed by a later take-in came between)
    new = h[h.rung == 0].sort_values("submitted")
    waiting_until = new.submitted.iloc[-len(workers)]
    subs, reps = np.sort(h.submitted.to_numpy()), np.sort(h.reported.to_numpy())
    for _, row in h[h.reported < waiting_until].iterrows():
        nxt = h[(h.worker == row.worker) & (h.submitted > row.reported)].submitted.min()
        assert not math.isnan(nxt), row
        between = subs[(subs > row.reported) & (subs < nxt)]
        assert not len(between) or not ((reps > between.min()) & (reps < nxt)).any(), row


@pytest.mark.slow
def test_cli_run_tune_writes_trials_and_best_model(tmp_path):
    import json
    import pickle

    import pandas as pd
    from click.testing import CliRunner

    pytest.importorskip("sklearn")
    from blockflow.cli import cli
    from blockflow.workloads.digits_tuning import digits_split

    out = tmp_path / "tuned"
    res = CliRunner().invoke(cli, ["run", "tune", "--configs", "9", "--max-epochs", "9",
                                   "--output", str(out), "--n-workers", "2",
                                   "--threads-per-worker", "1", "--gpu", "false",
                                   "--promotion", "asha"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "blockflow tune: 9 MLP configurations on digits, eta 3, up to 9 epochs" in res.output
    assert sorted(p.name for p in out.iterdir()) == [
        "best_model.pkl", "history.parquet", "manifest.json", "trials.parquet"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["promotion"] == "asha" and m["min_budget_epochs"] == 1
    trials = pd.read_parquet(out / "trials.parquet")
    history = pd.read_parquet(out / "history.parquet")
    assert len(trials) == 9 and m["trial_tasks"] == len(history) >= 9 + 3 + 1
    assert m["trials_by_status"].get("completed", 0) >= 1
    # the run's tasks per blockflow's plugin: each trial task and its small report task
    assert m["n_tasks"] == 2 * len(history)
    model = pickle.loads((out / "best_model.pkl").read_bytes())
    *_, X_te, y_te = digits_split()
    assert model.score(X_te, y_te) == pytest.approx(m["test_accuracy"]) and \
        m["test_accuracy"] > 0.8
    assert json.loads(trials.loc[m["best_trial"], "config"]) == m["best_config"]


def test_dashboard_shows_running_trials():
    import json
    import logging
    import threading
    import urllib.request

    from blockflow.cluster.connection import _register_plugin
    from blockflow.dashboard.page import BlockflowPage
    from blockflow.scheduling import Rebalancer

    configs = [{"x": i / 8, "unit": 0.3} for i in range(9)]
    with simulated_cluster(speeds=[1, 0.5], processes=False, silence_logs=logging.CRITICAL,
                           dashboard_address="127.0.0.1:0") as client:
        _register_plugin(client, Rebalancer(policy="dynamic"))
        port = client.cluster.scheduler.http_server.port
        out = {}
        th = threading.Thread(target=lambda: out.update(r=tune(
            train, configs, client=client, eta=3, max_budget=3, name="dash-test")))
        th.start()
        seen, html = [], [""]

        def sample_until_done():
            if not th.is_alive():
                return True
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/blockflow/status.json",
                                        timeout=20) as resp:
                tuning = json.loads(resp.read())["tuning"]
            if tuning and tuning["running"]:
                seen.append(tuning)
                page = BlockflowPage(client.cluster.scheduler)
                page.update()
                if "<td>" in page.tuning.text:  # the trials may have ended just now
                    html[0] = page.tuning.text
            return False

        wait_until(sample_until_done, timeout=120, interval=0.1, message="the tuning run to end")
        html_text = html[0]
        th.join(120)
        final = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{port}/blockflow/status.json", timeout=20).read())["tuning"]
    assert seen, "the status route never showed a running trial"
    t = seen[-1]
    assert t["name"] == "dash-test" and t["n_trials"] == 9
    workers = {r["worker"] for s in seen for r in s["running"]}
    assert len(workers) == 2 and all(len(s["running"]) <= 2 for s in seen), \
        [s["running"] for s in seen if len(s["running"]) > 2][:1]
    assert {"trial", "rung", "epochs", "worker", "since", "config"} <= set(t["running"][0])
    assert "<h4>Tuning: dash-test</h4>" in html_text and "<td>" in html_text
    assert final["finished"] and final["n_done"] == 9 and final["running"] == []
    assert final["best_trial"] == out["r"].best_trial == 8


@pytest.mark.slow
def test_worker_killed_mid_run_loses_no_trial():
    """A worker process killed while trials run: its running trial and the checkpoints it
    held are trained again elsewhere, and the run ends with every trial accounted for and
    the same best trial and score as an undisturbed run (the objective is deterministic)."""
    import os
    import signal

    xs = np.random.default_rng(5).permutation(27) / 26
    configs = [{"x": float(x), "unit": 0.15} for x in xs]
    with LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0",
                      silence_logs=50) as cluster, Client(cluster) as c:
        victim = sorted(c.nthreads())[0]
        pid = c.run(os.getpid, workers=[victim])[victim]
        out = {}

        def promoting():
            meta = c.get_metadata(["blockflow", "tune"], default=None)
            return meta and any(r["rung"] >= 1 for r in meta["running"])

        def kill_when_promoting():
            wait_until(promoting, timeout=60, message="a trial running on rung 1")
            os.kill(pid, signal.SIGKILL)
            out["killed"] = True

        import threading
        th = threading.Thread(target=kill_when_promoting)
        th.start()
        r = tune(train, configs, client=c, eta=3, min_budget=1, max_budget=9)
        th.join()
    assert out.get("killed")
    t = r.trials
    assert set(t.status) <= {"completed", "stopped"} and len(t) == 27
    best = int(np.argmax(xs))
    assert r.best_trial == best and math.isclose(r.best_score, 9 / 10)
    assert victim not in set(r.history.worker[r.history.started > 0].tail(5))


def nan_for_zero(cfg, epochs, checkpoint):
    """Diverges (a NaN score) for x == 0."""
    score, done = train(cfg, epochs, checkpoint)
    return (math.nan if cfg["x"] == 0 else score), done


@pytest.mark.parametrize("promotion", ["certain-first", "asha"])
def test_a_nan_score_ranks_below_every_number(client, promotion):
    """A diverged trial (score NaN) is never promoted over a real score nor reported best,
    in either order and in the synchronous baseline."""
    configs = [{"x": float(x), "unit": 0.002} for x in range(9)]
    for kw in ({"promotion": promotion}, {"synchronous": True}):
        r = tune(nan_for_zero, configs, client=client, eta=3, min_budget=1, max_budget=9,
                 **kw)
        assert r.best_trial == 8 and not math.isnan(r.best_score), kw
        assert r.trials.loc[0, "rung"] == 0 and r.trials.loc[0, "status"] == "stopped", kw
    r = tune(nan_for_zero, configs, client=client, eta=3, min_budget=1, max_budget=9,
             promotion=promotion, mode="min")
    assert r.best_trial == 1, r.trials  # x = 0 would be "best" if NaN compared as a number


@pytest.mark.parametrize("n", [1, 2, 8])
def test_small_runs_reach_the_top_rung_in_either_order(client, n):
    """Fewer results in a rung than eta: ASHA's rule promotes none, but synchronous SH takes
    at least one to the next rung, and so does each order."""
    configs = [{"x": float(x), "unit": 0.002} for x in range(n)]
    for promotion in ("certain-first", "asha"):
        r = tune(train, configs, client=client, eta=3, min_budget=1, max_budget=9,
                 promotion=promotion)
        assert r.best_trial == n - 1 and (r.trials.status == "completed").sum() >= 1, promotion
        assert r.trials.loc[n - 1, "budget"] == 9, promotion


def test_float_budgets_snap_to_max_and_bad_searches_are_refused(client):
    from blockflow.ml.tune.asha import rung_budgets

    assert rung_budgets(0.7, 2.1, 3) == [0.7, 2.1]  # 0.7 * 3 = 2.0999999999999996
    assert rung_budgets(1, 27, 3) == [1, 3, 9, 27] and rung_budgets(1, 10, 3) == [1, 3, 9, 10]
    assert rung_budgets(2, 2, 3) == [2]
    with pytest.raises(ValueError, match="no configurations"):
        tune(train, [], client=client)
    with pytest.raises(ValueError, match="no configurations"):
        tune(train, {"x": [1.0, 2.0]}, n_configs=0, client=client)
    with pytest.raises(ValueError, match="whole number eta"):
        tune(train, [{"x": 1.0}], client=client, eta=2.7)


def always_fails(cfg, epochs, checkpoint):
    raise ModuleNotFoundError("No module named 'sklearn'")


def test_every_trial_failing_warns_with_the_first_error(client):
    configs = [{"x": float(x)} for x in range(3)]
    with pytest.warns(RuntimeWarning, match="every one of the 3 trials failed.*sklearn"):
        r = tune(always_fails, configs, client=client, eta=3, min_budget=1, max_budget=3)
    assert (r.trials.status == "failed").all() and r.best_trial is None


def killer(cfg, epochs, checkpoint):
    """A trial that kills its worker process when ``cfg["kill"]``."""
    import os

    if cfg.get("kill"):
        os._exit(1)
    return train(cfg, epochs, checkpoint)


@pytest.mark.slow
def test_a_trial_that_kills_its_workers_is_named_not_its_internal_key():
    import dask

    configs = [{"x": x / 4, "kill": i == 1} for i, x in enumerate(range(4))]
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster) as c:
        r = tune(killer, configs, client=c, eta=2, min_budget=1, max_budget=1)
    error = r.trials.loc[1, "error"]
    assert error.startswith("WorkerLostError: the workers running trial 1 (rung 0, 1 epochs) "
                            "died 1 time (the last was tcp://"), error
    assert error.endswith("raise distributed.scheduler.allowed-failures if the deaths had "
                          "nothing to do with the trial."), error
    assert TRIAL_PREFIX not in error


def _set_base_speed(speed, dask_worker=None):
    from blockflow.testing.simulated import get_device

    get_device(dask_worker).base_speed = speed


def _drop_capacity(dask_worker=None):
    from blockflow._distributed import remove_worker_metric
    from blockflow._distributed.metrics import CAPACITY_METRIC

    remove_worker_metric(dask_worker, CAPACITY_METRIC)


@pytest.mark.parametrize("declared", [True, False], ids=["capacity", "no-capacity"])
def test_trials_go_to_the_fastest_devices_and_never_blind_twice(declared):
    """Issue 26: 8 devices (speeds 4, 2, 2, 1, 1, 1, 0.5, 0.5), 4 trials. The devices are
    given so that a blind tuner (each worker 1.0, the cluster's worker order) puts the 4
    trials on the slow ones (1, 1, 0.5, 0.5). When the devices declare their speed
    (``blockflow-capacity``) the first call already uses the 4 fastest; when they do not,
    the first call races copies on the idle devices and the second call, on the same
    cluster, uses what the first saw."""
    from blockflow._distributed.metrics import CAPACITY_METRIC
    from blockflow.testing.cluster import _heartbeat

    configs = [{"x": x} for x in (0.1, 0.9, 0.5, 0.3)]
    with simulated_cluster(speeds=[1] * 8, processes=False) as client:
        order = list(client.nthreads())  # the order a blind tuner fills threads in
        by_addr = dict(zip(order, (1, 1, 0.5, 0.5, 4, 2, 2, 1)))
        for a, s in by_addr.items():
            client.run(_set_base_speed, s, workers=[a])
        if not declared:
            client.run(_drop_capacity)
        client.run(_heartbeat)

        def metrics_reached():
            info = workers_info(client)
            caps = {a: (w.get("metrics") or {}).get(CAPACITY_METRIC) for a, w in info.items()}
            return caps == ({a: float(s) for a, s in by_addr.items()} if declared
                            else dict.fromkeys(by_addr))

        wait_until(metrics_reached, timeout=30, message="the devices' capacity metrics")
        step = slowed_to_device_speed(train, scale=4)
        runs = []
        for _ in range(2):
            r = tune(step, [{**c, "unit": 0.05} for c in configs], client=client, eta=3,
                     min_budget=1, max_budget=3)
            assert r.best_trial == 1 and r.trials.loc[1, "status"] == "completed"
            runs.append(r.history)
            time.sleep(0.5)  # cancelled copies end on their devices
    fastest = [4, 2, 2, 1]
    for call, h in enumerate(runs):
        backup = h["backup"].astype(bool) if "backup" in h else h.rung < 0
        first = h[(h.rung == 0) & ~backup]
        placed = sorted(first.worker.map(by_addr), reverse=True)
        if declared or call == 1:
            assert placed == fastest, (call, placed)
            assert not backup.any(), h
            # the promotion went to the fastest device
            assert h.loc[h.rung == 1, "worker"].map(by_addr).tolist() == [4], h
        else:  # blind: the 4 idle devices each ran a copy, whose times are evidence
            assert placed == [1, 1, 0.5, 0.5], placed
            assert backup.sum() == 4 and set(h.worker) == set(by_addr), h


def test_synchronous_tuning_gives_the_same_trials_and_model_whatever_the_workers(client):
    """Synchronous successive halving decides on whole rungs: on 3 workers and on 1 the
    same trials reach the same rungs with the same scores and the same best checkpoint
    (ASHA promotes in the order results arrive, so its promotions follow the timing)."""
    xs = np.random.default_rng(5).permutation(9) / 8
    configs = [{"x": float(x)} for x in xs]
    kw = dict(eta=3, min_budget=1, max_budget=9, synchronous=True, publish=False)
    r3 = tune(train, configs, client=client, **kw)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as one:
        r1 = tune(train, configs, client=one, **kw)
    cols = ["rung", "budget", "score", "status"]
    assert r3.trials[cols].equals(r1.trials[cols])
    assert r3.best_trial == r1.best_trial == int(np.argmax(xs))
    assert r3.best_checkpoint == r1.best_checkpoint and r3.best_score == r1.best_score
