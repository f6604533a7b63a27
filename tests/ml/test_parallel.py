"""Pipeline parallelism of PyTorch models on real clusters, checked against the
same model on one device (float64, 1e-10), trained models (a conv net on digits, a small
transformer), schedules, and lost workers."""

from __future__ import annotations

import functools
import itertools
import re

import numpy as np
import pytest
from distributed import Client, LocalCluster

import blockflow
from blockflow.scheduling.view import workers_info
from blockflow.errors import BlockflowWarning, WorkerLostError
from blockflow.ml.parallel import (
    PipelineParallel,
    bubble_fraction,
    equal_stages,
    parameter_stages,
    partition_stages,
    shard_widths,
)
from blockflow.ml.parallel.partition import flush_makespan, stage_times
from blockflow.testing import simulated_cluster

torch = pytest.importorskip("torch")

TOL = 1e-10


def max_diff(a, b) -> float:
    return float((torch.as_tensor(np.asarray(a)) - torch.as_tensor(np.asarray(b))).abs().max())


# --- planners: plain data ------------------------------------------------------------------


def test_shard_widths_follow_free_memory_and_sum_to_the_width():
    widths = shard_widths(100, {"a": 4e6, "b": 2e6, "c": 2e6}, 1000)
    assert widths == {"a": 50, "b": 25, "c": 25}
    widths = shard_widths(7, {"a": 3e6, "b": 1e6}, 1000)
    assert sum(widths.values()) == 7 and widths["a"] > widths["b"]
    widths = shard_widths(10, {"a": 0, "b": 10_000, "c": 10_000}, 1000)
    assert widths == {"b": 5, "c": 5}


def test_shard_widths_name_the_shortfall():
    with pytest.raises(blockflow.DeviceMemoryError, match=re.escape(
            "blockflow: the model's weights take 10,000 bytes but the 2 workers' free device "
            "memory allows 4,000 (memory fraction 0.5): short by 6,000 bytes; add workers or "
            "devices, or use a smaller model.")):
        shard_widths(10, {"a": 4000, "b": 4000}, 1000, memory_fraction=0.5)


def _brute_force(layer_times, p, sizes=None, caps=None):
    n = len(next(iter(layer_times.values())))
    best = np.inf
    for order in itertools.permutations(layer_times, p):
        for cuts in itertools.combinations(range(1, n), p - 1):
            bounds = [0, *cuts, n]
            if sizes is not None and any(sum(sizes[a:b]) > caps[w] for a, b, w in
                                         zip(bounds, bounds[1:], order)):
                continue
            best = min(best, max(stage_times(layer_times, bounds, order)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_partition_is_the_min_max_contiguous_split_within_memory(seed):
    rng = np.random.default_rng(seed)
    n, p = int(rng.integers(3, 8)), int(rng.integers(1, 4))
    cost = rng.uniform(0.1, 1.0, n)
    layer_times = {f"w{i}": list(cost / rng.uniform(0.2, 1.0)) for i in range(p)}
    order, bounds = partition_stages(layer_times, p)
    assert bounds[0] == 0 and bounds[-1] == n and len(order) == len(bounds) - 1 == p
    assert max(stage_times(layer_times, bounds, order)) == pytest.approx(
        _brute_force(layer_times, p))
    # with memory: no stage above its worker's capacity, still the best such split
    sizes = list(rng.uniform(1, 3, n))
    caps = {w: sum(sizes) / p * 1.5 for w in layer_times}
    order, bounds = partition_stages(layer_times, p, layer_bytes=sizes, capacity=caps)
    assert all(sum(sizes[a:b]) <= caps[w] for a, b, w in zip(bounds, bounds[1:], order))
    assert max(stage_times(layer_times, bounds, order)) == pytest.approx(
        _brute_force(layer_times, p, sizes, caps))


@pytest.mark.parametrize("seed", range(4))
def test_partition_with_micro_batches_minimises_the_step_and_its_bubble(seed):
    """With m, the split of least (m - 1) x slowest stage + one micro-batch's way through
    every stage and back + its hops, over every worker order and cut (brute force)."""
    rng = np.random.default_rng(seed)
    n, p, m = int(rng.integers(4, 9)), int(rng.integers(2, 4)), int(rng.integers(2, 9))
    cost = rng.uniform(0.1, 1.0, n)
    layer_times = {f"w{i}": list(cost / rng.uniform(0.2, 1.0)) for i in range(p)}
    hops = list(rng.uniform(0, 0.3, n - 1))

    def step(order, bounds):
        return flush_makespan(stage_times(layer_times, bounds, order), m,
                              sum(hops[b - 1] for b in bounds[1:-1]))

    best = min(step(order, [0, *cuts, n]) for order in itertools.permutations(layer_times)
               for cuts in itertools.combinations(range(1, n), p - 1))
    order, bounds = partition_stages(layer_times, p, n_micro_batches=m, transfer=hops)
    assert step(order, bounds) == pytest.approx(best)


def test_partition_refuses_a_model_no_split_fits():
    with pytest.raises(blockflow.DeviceMemoryError, match=re.escape(
            "blockflow: no split of the model's 3 layers (300 bytes of parameters, gradients "
            "and optimizer state) into 2 stages fits the workers' free device memory (200 "
            "bytes usable, largest layer 100); add workers or devices, or use a smaller "
            "model.")):
        partition_stages({"a": [1, 1, 1], "b": [1, 1, 1]}, 2, layer_bytes=[100] * 3,
                         capacity={"a": 100, "b": 100})


def test_speed_partition_and_the_baselines():
    layer_times = {"fast": [1.0] * 12, "slow": [4.0] * 12}
    order, bounds = partition_stages(layer_times)
    assert dict(zip(order, np.diff(bounds))) == {"fast": 10, "slow": 2}
    assert equal_stages(12, ["fast", "slow"]) == (["fast", "slow"], [0, 6, 12])
    assert equal_stages(7, ["a", "b", "c"])[1] == [0, 3, 5, 7]
    # DeepSpeed's partition by parameters: equal parameter counts, whatever the speed
    assert parameter_stages([10, 10, 0, 20, 0, 20], ["a", "b"]) == (["a", "b"], [0, 3, 6])


def test_bubble_fraction_of_a_perfect_gpipe_schedule():
    import pandas as pd

    p, m = 3, 6
    rows = [{"stage": s, "start": s + j, "stop": s + j + 1} for s in range(p) for j in range(m)]
    assert bubble_fraction(pd.DataFrame(rows)) == pytest.approx((p - 1) / (m + p - 1))


# --- pipeline parallelism: equal to one device ---------------------------------------------


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def pclient():
    """Worker processes: each holds one torch.distributed rank."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 16),
        torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def _reference(opt, X, T, batches, model=None, optimizer=None):
    ref = model or _mlp()
    o = optimizer or opt(ref.parameters())
    losses = []
    for lo, hi in batches:
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(torch.tensor(X[lo:hi])), torch.tensor(T[lo:hi]))
        loss.backward()
        losses.append(loss.item())
        o.step()
    return ref, losses


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b"])
def test_pipeline_loss_gradients_and_parameters_equal_one_device(pclient, schedule):
    """float64, torch's schedules over a group of two ranks: run() with batch 8 in
    micro-batches of 3, 3, 2 (padded for torch, the padding ignored) gives the loss,
    output and gradients of one process; then fit() for 18 more steps in segments of 5
    (one group each): losses and parameters over the 20 steps equal one process's."""
    rng = np.random.default_rng(3)
    X, T = rng.standard_normal((24, 6)), rng.standard_normal((24, 3))
    opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    m = 4 if schedule == "interleaved1f1b" else 3
    pipe = PipelineParallel(pclient, _mlp(), optimizer=opt, schedule=schedule, sample=X,
                            checkpoint_every=5)
    assert len(pipe.ranks) == 2 and pipe.layer_times is not None
    assert len(pipe.stage_workers) == (4 if schedule == "interleaved1f1b" else 2)
    ref = _mlp()
    ref_opt = opt(ref.parameters())
    for step in range(2):
        r = pipe.run(X[:8], T[:8], n_micro_batches=m, return_grads=True, publish=False)
        ref_opt.zero_grad()
        out = ref(torch.tensor(X[:8]))
        loss = torch.nn.functional.mse_loss(out, torch.tensor(T[:8]))
        loss.backward()
        assert abs(r.loss - loss.item()) < TOL
        assert max_diff(r.output, out.detach()) < TOL
        assert set(r.grads) == {n for n, _ in ref.named_parameters()}
        for n, prm in ref.named_parameters():
            assert max_diff(r.grads[n], prm.grad) < TOL, (step, n)
        ref_opt.step()
    if schedule != "interleaved1f1b":
        assert r.micro_batch_rows == [3, 3, 2]
    # the measured schedule: every micro-batch forward and backward on each stage's worker
    t = r.timeline
    assert len(t) == 2 * m * pipe.n_stages
    for s, df in t.groupby("stage"):
        assert set(df.worker) == {pipe.stage_workers[s]}
        assert sorted(df[df.phase == "forward"].micro_batch) == list(range(m))
        assert sorted(df[df.phase == "backward"].micro_batch) == list(range(m))
    # peak stashed activations per stage: GPipe all m, 1F1B at most the stages
    if schedule == "gpipe":
        assert r.peak_activations == [m] * pipe.n_stages
    else:
        assert all(1 <= a <= pipe.n_stages for a in r.peak_activations), r.peak_activations
    pipe.fit(X, T, epochs=6, batch_size=8, n_micro_batches=m if m == 4 else 2,
             shuffle=False)
    assert pipe.steps == 20 and len(pipe.history_) == 18
    ref, losses = _reference(opt, X, T, [(lo, lo + 8) for _ in range(6) for lo in (0, 8, 16)],
                             model=ref, optimizer=ref_opt)
    assert max(abs(h["loss"] - v) for h, v in zip(pipe.history_, losses)) < TOL
    state = pipe.state_dict()
    assert set(state) == set(ref.state_dict())
    for n, v in ref.state_dict().items():
        assert max_diff(state[n], v) < TOL, n
    # inference only: outputs, no gradients
    fwd = pipe.run(X, n_micro_batches=2, publish=False)
    assert fwd.grads is None and fwd.loss is None
    assert max_diff(fwd.output, ref(torch.tensor(X)).detach()) < TOL
    assert max_diff(pipe.predict(X, batch_size=10, n_micro_batches=2),
                    ref(torch.tensor(X)).detach()) < TOL


@pytest.mark.slow
def test_a_bfloat16_model_trains_and_keeps_its_dtype(pclient):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3)).to(torch.bfloat16)
    rng = np.random.default_rng(0)
    X, T = rng.standard_normal((16, 6)).astype(np.float32), rng.standard_normal((16, 3))
    pipe = PipelineParallel(pclient, model, optimizer=functools.partial(torch.optim.SGD,
                                                                        lr=0.05),
                            schedule="1f1b", partition="equal")
    pipe.fit(X, T, epochs=2, batch_size=8, n_micro_batches=2)
    assert len(pipe.history_) == 4 and all(np.isfinite(h["loss"]) for h in pipe.history_)
    assert {v.dtype for v in pipe.state_dict().values()} == {torch.bfloat16}
    assert pipe.predict(X).shape == (16, 3)


@pytest.mark.slow
def test_micro_batch_counts_the_batch_cannot_take_are_refused_before_running(pclient):
    pipe = PipelineParallel(pclient, _mlp(), partition="equal")
    rng = np.random.default_rng(0)
    X, T = rng.standard_normal((8, 6)), rng.standard_normal((8, 3))
    for m in (9, 0, 2.5):
        with pytest.raises(ValueError) as e:
            pipe.run(X, T, n_micro_batches=m, publish=False)
        assert str(e.value) == (f"blockflow: n_micro_batches={m!r} for a batch of 8 rows; a "
                                f"micro-batch needs at least one row: pass n_micro_batches "
                                f"between 1 and 8.")
    assert pipe.steps == 0  # nothing ran
    r = pipe.run(X, T, n_micro_batches=5, publish=False)  # 5 does not divide 8: 2,2,2,1,1
    assert r.micro_batch_rows == [2, 2, 2, 1, 1] and pipe.steps == 1


def test_batch_norm_is_refused_unless_the_user_opts_in(pclient):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 1))
    with pytest.raises(ValueError) as e:
        PipelineParallel(pclient, model, partition="equal")
    assert str(e.value) == (
        "blockflow: layer 1 is a BatchNorm1d: on micro-batches its statistics are each "
        "micro-batch's, not the batch's, so the pipelined model is not the same model; use "
        "LayerNorm or GroupNorm, or pass allow_batch_norm=True to accept per-micro-batch "
        "statistics.")
    pipe = PipelineParallel(pclient, model, partition="equal", allow_batch_norm=True)
    assert pipe.run(np.ones((4, 4), np.float32), np.ones((4, 1), np.float32),
                    n_micro_batches=2, publish=False).loss is not None


def test_a_model_that_is_not_sequential_or_cannot_be_pickled_is_refused():
    import threading

    with pytest.raises(TypeError, match=r"takes a torch.nn.Sequential or a list of "
                                        r"torch.nn.Module, got Linear"):
        PipelineParallel(None, torch.nn.Linear(2, 2))
    layer = torch.nn.Linear(3, 2)
    layer.guard = threading.Lock()
    with pytest.raises(TypeError, match=re.escape(
            "blockflow.parallel.PipelineParallel: cannot ship the model to the workers: "
            "model['1'].guard is a _thread.lock that cannot be pickled")):
        PipelineParallel(None, [torch.nn.Linear(2, 3), layer])


@pytest.mark.slow
def test_dropout_is_seeded_so_runs_repeat(pclient):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Dropout(0.5),
                                   torch.nn.Linear(32, 32), torch.nn.Dropout(0.5),
                                   torch.nn.Linear(32, 1)).double()

    rng = np.random.default_rng(0)
    X, T = rng.standard_normal((12, 5)), rng.standard_normal((12, 1))
    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    losses = []
    for seed in (7, 7, 8):
        pipe = PipelineParallel(pclient, model(), optimizer=sgd, partition="equal", seed=seed)
        pipe.fit(X, T, epochs=3, batch_size=12, n_micro_batches=4, shuffle=False)
        losses.append([h["loss"] for h in pipe.history_])
    assert losses[0] == losses[1] and losses[0] != losses[2]


def test_fit_needs_an_optimizer(pclient):
    pipe = PipelineParallel(pclient, _mlp(), partition="equal")
    with pytest.raises(ValueError, match=r"^blockflow: fit\(\) needs an optimizer: pass "
                                         r"optimizer= to PipelineParallel"):
        pipe.fit(np.ones((4, 6)), np.ones((4, 3)))


# --- trained models --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_conv_net_with_residual_blocks_layernorm_and_gelu_learns_the_digits(pclient):
    """Held-out accuracy >= 0.9 after 4 epochs of Adam through a 2-stage 1F1B pipeline."""
    import dask.array as da

    from blockflow.workloads.models import conv_net, digits

    X, y = digits()
    adam = functools.partial(torch.optim.Adam, lr=3e-3)
    pipe = PipelineParallel(pclient, conv_net(), optimizer=adam, schedule="1f1b",
                            loss=torch.nn.CrossEntropyLoss())
    pipe.fit(da.from_array(X[:1400], chunks=(350, 64)), da.from_array(y[:1400], chunks=350),
             epochs=4, batch_size=100, n_micro_batches=4)
    assert len(pipe.stage_workers) == 2 and pipe.steps == 56
    accuracy = (pipe.predict(X[1400:]).argmax(1) == y[1400:]).mean()
    assert accuracy >= 0.9, accuracy
    # state_dict() reassembled on the client gives the same predictions on one device
    model = conv_net()
    model.load_state_dict(pipe.state_dict())
    model.eval()
    with torch.no_grad():
        local = model(torch.as_tensor(X[1400:])).argmax(1).numpy()
    assert (local == pipe.predict(X[1400:]).argmax(1)).all()


@pytest.mark.slow
def test_a_small_transformer_learns_the_sequence_task(pclient):
    """A stack of 4 nn.TransformerEncoderLayer: held-out accuracy >= 0.95."""
    from blockflow.workloads.models import sequence_task, transformer

    X, y = sequence_task(800, seed=0)  # 16 steps: single-device Adam reaches 1.0 by then
    Xt, yt = sequence_task(400, seed=1)
    adam = functools.partial(torch.optim.Adam, lr=3e-3)
    pipe = PipelineParallel(pclient, transformer(), optimizer=adam,
                            loss=torch.nn.CrossEntropyLoss())
    pipe.fit(X, y, epochs=2, batch_size=100, n_micro_batches=4)
    accuracy = (pipe.predict(Xt).argmax(1) == yt).mean()
    assert accuracy >= 0.95, accuracy
    assert pipe.history_[-1]["loss"] < pipe.history_[0]["loss"]


# --- faults ----------------------------------------------------------------------------------


def _pid():
    import os
    return os.getpid()


def _kill(client, worker):
    import os
    import signal

    os.kill(client.run(_pid)[worker], signal.SIGKILL)


@pytest.mark.slow
def test_a_lost_stage_worker_re_forms_the_group_on_the_survivors_and_resumes():
    """3 worker processes, 3 stages: the last stage's worker is killed during fit; one
    warning names it and its stage, the group re-forms on the 2 survivors (the layers
    re-partitioned) from the last checkpoint, and the final parameters equal one process's
    (float64, 1e-10)."""
    import threading
    import warnings

    rng = np.random.default_rng(1)
    X, T = rng.standard_normal((64, 6)), rng.standard_normal((64, 3))
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5)
    cluster = LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                           dashboard_address=":0")
    c = Client(cluster)
    try:
        pipe = PipelineParallel(c, _mlp(), optimizer=sgd, partition="equal",
                                checkpoint_every=2)
        victim = pipe.stage_workers[2]

        def kill_at(epoch, step, loss):
            if step == 4 and victim in workers_info(c):
                threading.Thread(target=_kill, args=(c, victim)).start()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.fit(X, T, epochs=3, batch_size=16, n_micro_batches=4, shuffle=False,
                     callback=kill_at)
        assert victim not in pipe.stage_workers and pipe.steps == 12
        assert len(pipe.ranks) == 2
        (rec,) = pipe.recoveries
        assert rec["lost"] == [victim] and rec["stages"] == ["stage 2 (layers 4-5)"]
        assert rec["resumed_from"] >= 4 and rec["redone"] >= 1
        lines = [str(w.message) for w in caught if issubclass(w.category, BlockflowWarning)]
        assert len(lines) == 1 and victim in lines[0] and "stage 2" in lines[0], lines
        state = pipe.state_dict()
    finally:  # worker processes of a loaded machine can take long to exit
        c.close()
        cluster.close(timeout=120)
    ref, _ = _reference(sgd, X, T, [(lo, lo + 16) for _ in range(3) for lo in range(0, 64, 16)])
    for n, v in ref.state_dict().items():
        assert max_diff(state[n], v) < TOL, n


@pytest.mark.slow
def test_a_lost_stage_nothing_can_take_is_one_error_naming_it():
    """Two simulated devices, each with room for one stage: when one is lost, the survivor
    cannot take its stage, and the step ends with one error naming the stage."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).double()
    stage = 2 * 64 * 65 * 8  # parameters and gradients of one layer
    with simulated_cluster(speeds=(1, 1), device_memory=int(stage * 1.5),
                           processes=True) as c:
        pipe = PipelineParallel(c, model, sample=np.ones((8, 64)),
                                optimizer=functools.partial(torch.optim.SGD, lr=0.01))
        X = np.ones((8, 64))
        pipe.run(X, X, n_micro_batches=2, publish=False)
        victim = pipe.stage_workers[1]
        _kill(c, victim)
        with pytest.raises(WorkerLostError) as e:  # not a wait: the suite's timeout bounds it
            pipe.run(X, X, n_micro_batches=2, publish=False)
    assert re.fullmatch(
        rf"blockflow: the pipeline step over 8 rows failed: lost stage 1 \(layer 1\) on "
        rf"worker {re.escape(victim)}, and (?:the 1 surviving workers have no room for its "
        rf"layers \(.*\)|its checkpoint was lost with it \(no second worker held a copy\)); "
        rf"add a worker and build the PipelineParallel again\.",
        str(e.value)), str(e.value)


async def _update(page):
    page.update()


@pytest.mark.slow
def test_pipeline_timeline_in_the_run_report_and_on_the_dashboard_page():
    import json
    import time
    import urllib.request

    from blockflow.dashboard.page import BlockflowPage

    client = blockflow.connect(gpu=False, n_workers=2, threads_per_worker=1, processes=True,
                               dashboard_address="127.0.0.1:0")
    try:
        since = time.time()
        rng = np.random.default_rng(5)
        pipe = PipelineParallel(client, _mlp(), partition="equal")
        result = pipe.run(rng.standard_normal((24, 6)), rng.standard_normal((24, 3)),
                          n_micro_batches=6, name="demo")
        report = blockflow.run_report(client, since=since)
        assert report.pipeline is not None and report.pipeline["name"] == "demo"
        assert report.pipeline["stages"] == 2 and report.pipeline["micro_batches"] == 6
        assert report.pipeline["timeline"].equals(result.timeline.reset_index(drop=True))
        assert "pipeline 'demo': 2 stages, 6 micro-batches" in repr(report)
        page = BlockflowPage(client.cluster.scheduler)
        client.sync(_update, page)
        assert page.pipeline_fig.visible
        assert len(page.pipeline.data["start"]) == 24  # 2 stages x 6 x (forward, backward)
        port = client.cluster.scheduler.http_server.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/blockflow/status.json",
                                    timeout=30) as reply:
            data = json.loads(reply.read())
        assert len(data["pipeline"]["timeline"]["stage"]) == 24
        pipe.close()
    finally:
        client.shutdown()
        client.close()


# --- on a real GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_pipeline_on_a_cuda_device_equals_the_cpu_model():
    """Stages live on the CUDA device (the rank's, nccl); float64 results equal
    the same model on the CPU (GPU float64 kernels differ from the CPU's in the last bits)."""
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with CUDA and an NVIDIA GPU (torch.cuda.is_available() "
                    "is False)")
    rng = np.random.default_rng(5)
    X, T = rng.standard_normal((8, 6)), rng.standard_normal((8, 3))
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        # one GPU holds one nccl rank: a one-stage group (the transport is torch's)
        pipe = PipelineParallel(c, _mlp(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                schedule="1f1b", sample=X)
        r = pipe.run(X, T, n_micro_batches=4, return_grads=True)
        ref = _mlp()
        out = ref(torch.tensor(X))
        loss = torch.nn.functional.mse_loss(out, torch.tensor(T))
        loss.backward()
        assert abs(r.loss - loss.item()) < 1e-9
        assert max_diff(r.output, out.detach()) < 1e-9
        for n, prm in ref.named_parameters():
            assert max_diff(r.grads[n], prm.grad) < 1e-9, n
