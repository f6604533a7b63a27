"""Model (tensor) parallelism and pipeline parallelism on real clusters, checked against a
single-device PyTorch model (float64, 1e-6 relative)."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from distributed import Client, LocalCluster, futures_of

import blockflow
from blockflow.cluster.identity import workers_info
from blockflow.ml.parallel import (
    Linear,
    PipelineParallel,
    ReLU,
    Tanh,
    TensorParallelMLP,
    bubble_fraction,
    equal_stages,
    partition_stages,
    shard_widths,
)
from blockflow.ml.parallel.layers import Layer, to_torch
from blockflow.ml.parallel.partition import stage_times
from blockflow.testing import simulated_cluster, simulated_kernel

torch = pytest.importorskip("torch")

RTOL = 1e-6


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# --- planners: plain data ------------------------------------------------------------------


def test_shard_widths_follow_free_memory_and_sum_to_the_width():
    widths = shard_widths(100, {"a": 4e6, "b": 2e6, "c": 2e6}, 1000)
    assert widths == {"a": 50, "b": 25, "c": 25}
    widths = shard_widths(7, {"a": 3e6, "b": 1e6}, 1000)
    assert sum(widths.values()) == 7 and widths["a"] > widths["b"]
    # a worker with no room gets nothing; the others hold everything within budget
    widths = shard_widths(10, {"a": 0, "b": 10_000, "c": 10_000}, 1000)
    assert widths == {"b": 5, "c": 5}


def test_shard_widths_name_the_shortfall():
    with pytest.raises(blockflow.DeviceMemoryError, match=re.escape(
            "blockflow: the model's weights take 10,000 bytes but the 2 workers' free device "
            "memory allows 4,000 (memory fraction 0.5): short by 6,000 bytes; add workers or "
            "devices, or use a smaller model.")):
        shard_widths(10, {"a": 4000, "b": 4000}, 1000, memory_fraction=0.5)


def _brute_force(layer_times, p):
    n = len(next(iter(layer_times.values())))
    best = np.inf
    for order in itertools.permutations(layer_times, p):
        for cuts in itertools.combinations(range(1, n), p - 1):
            bounds = [0, *cuts, n]
            best = min(best, max(stage_times(layer_times, bounds, order)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_partition_is_the_min_max_contiguous_split(seed):
    rng = np.random.default_rng(seed)
    n, p = int(rng.integers(3, 8)), int(rng.integers(1, 4))
    cost = rng.uniform(0.1, 1.0, n)
    layer_times = {f"w{i}": list(cost / rng.uniform(0.2, 1.0)) for i in range(p)}
    order, bounds = partition_stages(layer_times, p)
    assert bounds[0] == 0 and bounds[-1] == n and len(order) == len(bounds) - 1 == p
    assert all(b > a for a, b in zip(bounds, bounds[1:]))
    got = max(stage_times(layer_times, bounds, order))
    assert got == pytest.approx(_brute_force(layer_times, p))


def test_speed_partition_gives_slow_workers_fewer_layers():
    cost = [1.0] * 12
    layer_times = {"fast": cost, "slow": [4 * c for c in cost]}
    order, bounds = partition_stages(layer_times)
    sizes = dict(zip(order, np.diff(bounds)))
    assert sizes == {"fast": 10, "slow": 2}  # max(10, 8) beats max(9, 12) and 6/6's 24
    assert equal_stages(12, ["fast", "slow"]) == (["fast", "slow"], [0, 6, 12])
    assert equal_stages(7, ["a", "b", "c"])[1] == [0, 3, 5, 7]


# --- tensor parallelism -------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def _blocks(rng, sizes, hidden):
    return [(rng.standard_normal((sizes[k], hidden[k])), rng.standard_normal(hidden[k]),
             rng.standard_normal((hidden[k], sizes[k + 1])) / 4,
             rng.standard_normal(sizes[k + 1]))
            for k in range(len(sizes) - 1)]


def _torch_reference(blocks, X, G, activation="tanh"):
    act = torch.tanh if activation == "tanh" else torch.relu
    params = [[torch.tensor(v, requires_grad=True) for v in blk] for blk in blocks]
    x = torch.tensor(X)
    for A, a, B, b in params:
        x = act(x @ A + a) @ B + b
    x.backward(torch.tensor(G))
    return x.detach().numpy(), [{n: p.grad.numpy() for n, p in zip("AaBb", blk)}
                                for blk in params]


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_tensor_parallel_forward_and_gradients_equal_one_device(client, activation):
    rng = np.random.default_rng(1)
    blocks = _blocks(rng, [10, 14, 6], [33, 20])
    model = TensorParallelMLP(client, blocks, activation=activation)
    assert len(model.widths) == 3 and sum(model.widths.values()) == 53
    X = rng.standard_normal((25, 10))
    y = model.forward(X)
    G = rng.standard_normal(y.shape)
    grads = model.backward(G)
    want_y, want_grads = _torch_reference(blocks, X, G, activation)
    assert rel_err(y, want_y) < RTOL
    for got, want in zip(grads, want_grads):
        for name in "AaBb":
            assert got[name].shape == want[name].shape
            assert rel_err(got[name].compute(), want[name]) < RTOL, name
    # A is split by columns and B by rows, one shard per worker, and each shard's
    # gradients are computed and held on the worker that holds the shard
    for k, blk in enumerate(model.weights):
        assert blk["A"].chunks[1] == blk["B"].chunks[0] == blk["a"].chunks[0]
        assert len(blk["A"].chunks[1]) == 3
        for name in "AaB":
            held = [next(iter(client.who_has(f)[f.key])) for f in futures_of(blk[name])]
            grad_at = [next(iter(client.who_has(f)[f.key]))
                       for f in futures_of(grads[k][name])]
            assert held == grad_at == model.workers


@pytest.mark.slow
def test_a_model_larger_than_any_device_runs_within_each_devices_memory():
    rng = np.random.default_rng(2)
    blocks = _blocks(rng, [32, 32, 32], [400, 400])  # 2 x 400 x 65 x 8 = 416,000 B + biases
    need = sum(sum(a.nbytes for a in blk) for blk in blocks)
    memory = [200_000, 150_000, 100_000]  # every device below the model, all together above
    assert need > max(memory) and need < 0.8 * sum(memory) * 1.4
    with simulated_cluster(speeds=(1, 1, 1), device_memory=memory, processes=False) as c:
        by_name = {info["name"]: a for a, info in
                   workers_info(c).items()}
        model = TensorParallelMLP(c, blocks, memory_fraction=1.0)
        widths = [model.widths[by_name[i]] for i in range(3)]
        assert widths[0] > widths[1] > widths[2]  # proportional to free device memory
        assert widths[0] / widths[2] == pytest.approx(2.0, rel=0.05)
        X = rng.standard_normal((16, 32))
        with model.track_weight_bytes(interval=0.02) as tracker:
            y = model.forward(X)
            G = rng.standard_normal(y.shape)
            grads = model.backward(G)
            got_grads = [{n: g[n].compute() for n in "AaBb"} for g in grads]
        want_y, want_grads = _torch_reference(blocks, X, G)
        assert rel_err(y, want_y) < RTOL
        for got, want in zip(got_grads, want_grads):
            for name in "AaBb":
                assert rel_err(got[name], want[name]) < RTOL
        for i in range(3):
            w = by_name[i]
            assert tracker.peak[w] <= 1.1 * model.shard_bytes[w]
            assert model.shard_bytes[w] <= memory[i]
        # the same model on one device alone is refused, naming the shortfall
        with pytest.raises(blockflow.DeviceMemoryError, match=(
                r"^blockflow: the model's weights take [\d,]+ bytes but the 1 workers' free "
                r"device memory allows 200,000 \(memory fraction 1\): short by [\d,]+ bytes; "
                r"add workers or devices, or use a smaller model\.$")):
            TensorParallelMLP(c, blocks, memory_fraction=1.0, workers=[by_name[0]])


def test_tensor_parallel_refuses_blocks_that_do_not_chain(client):
    rng = np.random.default_rng(0)
    blocks = _blocks(rng, [4, 5, 6], [3, 3])
    blocks[1] = (rng.standard_normal((7, 3)),) + blocks[1][1:]
    with pytest.raises(ValueError, match="block 1 takes 7 features but block 0 gives 5"):
        TensorParallelMLP(client, blocks)


# --- pipeline parallelism -----------------------------------------------------------------


def _mlp(rng, widths, act=Tanh):
    layers = []
    for k in range(len(widths) - 1):
        layers.append(Linear(rng.standard_normal((widths[k], widths[k + 1])) / 3,
                             rng.standard_normal(widths[k + 1])))
        if k < len(widths) - 2:
            layers.append(act())
    return layers


@pytest.mark.slow
def test_pipeline_outputs_and_gradients_equal_the_unpipelined_model(client):
    rng = np.random.default_rng(3)
    layers = _mlp(rng, [6, 16, 16, 12, 3]) + [ReLU()]
    pipe = PipelineParallel(client, layers)
    assert len(pipe.stage_workers) == 3 and pipe.layer_times is not None
    X, T = rng.standard_normal((50, 6)), rng.standard_normal((50, 3))
    result = pipe.run(X, T, n_micro_batches=8)

    ref = to_torch(layers)
    out = ref(torch.tensor(X))
    loss = torch.nn.functional.mse_loss(out, torch.tensor(T))
    loss.backward()
    assert rel_err(result.output, out.detach().numpy()) < RTOL
    assert result.loss == pytest.approx(loss.item(), rel=RTOL)
    linear = [m for m in ref if isinstance(m, torch.nn.Linear)]
    got = [g for g in result.grads if g]
    assert len(got) == len(linear) == 4 and len(result.grads) == len(layers)
    for g, m in zip(got, linear):
        assert rel_err(g["W"], m.weight.grad.numpy().T) < RTOL
        assert rel_err(g["b"], m.bias.grad.numpy()) < RTOL

    # GPipe: every micro-batch forward and backward on each stage, on the stage's worker;
    # a stage's backward passes start after its last forward pass
    t = result.timeline
    assert len(t) == 2 * 3 * 8
    for s, df in t.groupby("stage"):
        assert set(df.worker) == {pipe.stage_workers[s]}
        assert sorted(df[df.phase == "forward"].micro_batch) == list(range(8))
        assert df[df.phase == "forward"].stop.max() <= df[df.phase == "backward"].start.min()
        assert sorted(df[df.phase == "backward"].micro_batch) == list(range(8))
    assert 0 <= result.bubble < 1 and result.ideal_bubble == pytest.approx(2 / 10)

    # inference only: outputs, no gradients
    fwd = pipe.run(X, n_micro_batches=5)
    assert fwd.grads is None and rel_err(fwd.output, out.detach().numpy()) < RTOL


def test_bubble_fraction_of_a_perfect_gpipe_schedule():
    import pandas as pd

    p, m = 3, 6
    rows = [{"stage": s, "start": s + j, "stop": s + j + 1} for s in range(p) for j in range(m)]
    t = pd.DataFrame(rows)
    assert bubble_fraction(t) == pytest.approx((p - 1) / (m + p - 1))


class SleepyLinear(Linear):
    """A linear layer whose forward and backward also take ``work`` reference-seconds on the
    worker's simulated device (``work / speed`` seconds)."""

    def __init__(self, W, b=None, work=0.01):
        super().__init__(W, b)
        self.work = work

    def forward(self, x):
        simulated_kernel(op=lambda: None, work=self.work)
        return super().forward(x)

    def backward(self, saved, dy):
        simulated_kernel(op=lambda: None, work=2 * self.work)
        return super().backward(saved, dy)


@pytest.mark.slow
def test_speed_partition_follows_measured_device_speeds():
    rng = np.random.default_rng(4)
    layers = [SleepyLinear(rng.standard_normal((8, 8)) / 3, work=0.01) for _ in range(10)]
    with simulated_cluster(speeds=(1, 0.25), processes=False) as c:
        names = {a: info["name"] for a, info in
                 workers_info(c).items()}
        pipe = PipelineParallel(c, layers)
        sizes = {names[w]: int(n) for w, n in zip(pipe.stage_workers, np.diff(pipe.bounds))}
        assert sizes[0] > sizes[1] and sizes[0] >= 7  # the fast device takes the most layers
        measured = {names[w]: sum(v) for w, v in pipe.layer_times.items()}
        assert measured[1] > 2.5 * measured[0]  # speed 0.25 vs 1, seen by measurement
        equal = PipelineParallel(c, layers, partition="equal")
        assert max(pipe.predicted_stage_times) < max(
            stage_times(pipe.layer_times, equal.bounds, equal.stage_workers))
        X, T = rng.standard_normal((32, 8)), rng.standard_normal((32, 8))
        a, b = pipe.run(X, T, n_micro_batches=4), equal.run(X, T, n_micro_batches=4)
        np.testing.assert_allclose(a.output, b.output, rtol=1e-12)
        for ga, gb in zip(a.grads, b.grads):
            np.testing.assert_allclose(ga["W"], gb["W"], rtol=1e-12)


class Broken(Layer):
    params: dict = {}

    def forward(self, x):
        return x, None


def test_pipeline_refuses_bad_partitions(client):
    layers = _mlp(np.random.default_rng(0), [2, 3, 2])
    workers = sorted(workers_info(client))[:2]
    with pytest.raises(ValueError, match=re.escape(
            "blockflow: partition bounds must rise from 0 to 3 with one stage per worker, "
            "got [0, 3, 3] for 2 workers.")):
        PipelineParallel(client, layers, partition=(workers, [0, 3, 3]))
    with pytest.raises(ValueError, match="cannot tell the model's input width"):
        PipelineParallel(client, [Broken()])


async def _update(page):
    page.update()


@pytest.mark.slow
def test_pipeline_timeline_in_the_run_report_and_on_the_dashboard_page():
    import json
    import time
    import urllib.request

    from blockflow.dashboard.page import BlockflowPage

    client = blockflow.connect(gpu=False, n_workers=2, threads_per_worker=1, processes=False,
                               dashboard_address="127.0.0.1:0")
    try:
        since = time.time()
        rng = np.random.default_rng(5)
        pipe = PipelineParallel(client, _mlp(rng, [4, 8, 8, 2]), partition="equal")
        result = pipe.run(rng.standard_normal((24, 4)), rng.standard_normal((24, 2)),
                          n_micro_batches=6, name="demo")
        report = blockflow.run_report(client, since=since)
        assert report.pipeline is not None and report.pipeline["name"] == "demo"
        assert report.pipeline["stages"] == 2 and report.pipeline["micro_batches"] == 6
        assert report.pipeline["timeline"].equals(result.timeline.reset_index(drop=True))
        assert report.pipeline["bubble"] == pytest.approx(result.bubble)
        assert "pipeline 'demo': 2 stages, 6 micro-batches" in repr(report)
        assert "pipeline &#x27;demo&#x27;: 2 stages" in report._repr_html_()
        # a report of a later window shows no pipeline
        assert blockflow.run_report(client, since=time.time() + 1).pipeline is None

        page = BlockflowPage(client.cluster.scheduler)
        client.sync(_update, page)
        assert page.pipeline_fig.visible
        assert "Pipeline demo: 2 stages, 6 micro-batches" in page.pipeline_fig.title.text
        assert len(page.pipeline.data["start"]) == 24  # 2 stages x 6 x (forward, backward)
        assert sorted(set(page.pipeline.data["stage"])) == ["stage 0", "stage 1"]
        # and in the JSON route the page's data come from
        port = client.cluster.scheduler.http_server.port
        url = f"http://127.0.0.1:{port}/blockflow/status.json"
        with urllib.request.urlopen(url, timeout=30) as reply:
            data = json.loads(reply.read())
        assert data["pipeline"]["name"] == "demo"
        assert len(data["pipeline"]["timeline"]["stage"]) == 24
        pipe.close()
    finally:
        client.shutdown()
        client.close()


@pytest.mark.gpu
def test_tensor_shards_live_in_device_memory_on_gpu_workers():
    """On a worker that sees a GPU, the shards are CuPy arrays and the passes still equal
    single-device PyTorch."""
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'blockflow[gpu]')")
    from blockflow.backends import gpu_device_count

    if gpu_device_count() == 0:
        pytest.skip("no NVIDIA GPU visible to this process")
    rng = np.random.default_rng(6)
    blocks = _blocks(rng, [8, 8], [40])
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        with TensorParallelMLP(c, blocks) as model:
            shard = futures_of(model.weights[0]["A"])[0].result()
            assert type(shard).__module__.split(".")[0] == "cupy"
            X = rng.standard_normal((12, 8))
            y = model.forward(X)
            G = rng.standard_normal(y.shape)
            grads = model.backward(G)
            want_y, want_grads = _torch_reference(blocks, X, G)
            assert isinstance(y, np.ndarray) and rel_err(y, want_y) < RTOL
            got_A = grads[0]["A"].compute()
            got_A = got_A.get() if hasattr(got_A, "get") else got_A
            assert rel_err(got_A, want_grads[0]["A"]) < RTOL


def test_a_layer_that_cannot_be_pickled_is_refused_before_anything_runs():
    import threading

    from blockflow.ml._pickling import FIX_TRAIN

    layers = [Linear(np.ones((3, 2))), Linear(np.ones((2, 1)))]
    layers[1].guard = threading.Lock()
    with pytest.raises(TypeError) as e:  # no client needed: refused before it is used
        PipelineParallel(None, layers)
    assert str(e.value) == (
        "blockflow.parallel.PipelineParallel: cannot ship the model to the workers: "
        "layers[1].guard is a _thread.lock that cannot be pickled (TypeError: cannot pickle "
        f"'_thread.lock' object); {FIX_TRAIN}.")


def _pid():
    import os
    return os.getpid()


@pytest.mark.slow
def test_a_lost_stage_worker_is_named_by_stage_worker_and_rows_not_internal_keys():
    import os
    import signal

    from blockflow.errors import WorkerLostError

    rng = np.random.default_rng(3)
    layers = _mlp(rng, [6, 16, 16, 12, 3])
    X, T = rng.standard_normal((64, 6)), rng.standard_normal((64, 3))
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        pipe = PipelineParallel(client, layers, partition="equal")
        pipe.run(X, T, n_micro_batches=4)  # placed and running
        victim = pipe.stage_workers[1]
        os.kill(client.run(_pid)[victim], signal.SIGKILL)
        with pytest.raises(WorkerLostError) as e:
            pipe.run(X, T, n_micro_batches=4)
    a, b = pipe.bounds[1], pipe.bounds[2] - 1
    assert str(e.value) == (
        f"blockflow: the pipeline pass over rows 0-63 (4 micro-batches) failed: lost stage 1 "
        f"(layers {a}-{b}) on worker {victim}, which left the cluster; the stage's layers "
        f"and their state went with it: build the PipelineParallel again on the workers "
        f"left and run the pass again.")
    assert e.value.lost == {victim}
