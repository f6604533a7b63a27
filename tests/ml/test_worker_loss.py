"""A worker lost under the AI entry points: the user hears one line in their own terms (the
blocks, stage, shard or worker), never an internal key, class or traceback; and an error
path leaves nothing of blockflow's on the workers (no "lost scattered data" at shutdown).

Real clusters of worker processes, killed with SIGKILL (their nanny starts a new one at
another address); nothing of Dask or torch is mocked.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import re
import signal

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

from blockflow.errors import NonFiniteError, WorkerLostError
from blockflow.scheduling.view import workers_info
from loadaware import scaled, wait_until

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # clusters of worker processes

LOST_SOURCE = (r"^blockflow: blocks 1 \(rows 100-199\), 4 \(rows 400-499\) came from data "
               r"scattered only to {held}, and Dask cannot recompute scattered data; pass "
               r"the arrays themselves \(NumPy, or a dask array built from them\) or keep "
               r"copies of the scattered data on several workers \(client\.replicate\("
               r"futures, n=2\), or scatter\(\.\.\., broadcast=True\)\)\.$")


def _kill(client, worker):
    """End ``worker``'s process at once and wait until the scheduler has dropped it."""
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
    wait_until(lambda: worker not in workers_info(client), timeout=scaled(60),
               message=f"{worker} to leave")


@pytest.fixture
def three():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


def _scattered(client, X, y, rows=100):
    """X and y as dask arrays of blocks the user scattered, block j only on worker j % 3."""
    client.wait_for_workers(3, timeout=scaled(60))  # a killed worker's nanny restarts it
    ws = sorted(workers_info(client))
    parts = [client.scatter([X[lo:lo + rows], y[lo:lo + rows]], workers=[ws[j % 3]],
                            hash=False) for j, lo in enumerate(range(0, len(X), rows))]
    Xd = da.concatenate([da.from_delayed(fx, (rows,) + X.shape[1:], dtype=X.dtype)
                         for fx, _ in parts])
    yd = da.concatenate([da.from_delayed(fy, (rows,) + y.shape[1:], dtype=y.dtype)
                         for _, fy in parts])
    return ws, parts, Xd, yd


def _data(rows=600, cols=8):
    rng = np.random.default_rng(0)
    return rng.standard_normal((rows, cols)), rng.standard_normal((rows, 1))


def _trainer(client, **kw):
    from blockflow.ml import DataParallelTrainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 1)).double()
    return DataParallelTrainer(model, torch.nn.MSELoss(), client=client, batch_size=60,
                               epochs=2, checkpoint_every=2, **kw)


def _one_line(excinfo):
    """The error is blockflow's public class, one line, with no internal error chained."""
    e = excinfo.value
    assert type(e) is WorkerLostError and "\n" not in str(e)
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


def test_training_on_scattered_blocks_lost_with_their_worker_names_the_blocks(three):
    """Blocks the user scattered to one worker, that worker killed between the scatter and
    the fit, then during a fit: one line naming the blocks (and, during the fit, the
    worker), never FuturesCancelledError on internal keys."""
    X, y = _data()
    ws, parts, Xd, yd = _scattered(three, X, y)
    _kill(three, ws[1])  # held blocks 1 and 4
    with pytest.raises(WorkerLostError, match=LOST_SOURCE.format(
            held="a worker that left the cluster")) as excinfo:
        _trainer(three).fit(Xd, yd)
    _one_line(excinfo)

    ws, parts, Xd, yd = _scattered(three, X, y)
    victim = ws[1]

    def kill_after_first_segment(trainer, record):
        if record["step"] == 1:
            _kill(three, victim)

    # the worker is named when the fit saw it leave; under load the scheduler may have
    # dropped it (and its blocks) before the fit looked
    with pytest.raises(WorkerLostError, match=LOST_SOURCE.format(
            held=f"(?:worker {re.escape(victim)}, which left the cluster|a worker that left "
                 f"the cluster)")) as excinfo:
        _trainer(three, callback=kill_after_first_segment).fit(Xd, yd)
    _one_line(excinfo)


def test_a_glm_on_scattered_blocks_lost_with_their_worker_names_the_blocks(three):
    from blockflow.ml.glm import LinearRegression

    X, y = _data()
    ws, parts, Xd, yd = _scattered(three, X, y[:, 0])
    _kill(three, ws[1])
    with pytest.raises(WorkerLostError, match=LOST_SOURCE.format(
            held="a worker that left the cluster")) as excinfo:
        LinearRegression().fit(Xd, yd)
    _one_line(excinfo)


def test_training_from_a_dask_collection_recomputes_what_a_killed_worker_held(three):
    """A dask collection's blocks are recomputed: the fit ends with the model of a fit that
    lost nothing."""
    X, y = _data()
    Xd, yd = da.from_array(X, chunks=(100, -1)), da.from_array(y, chunks=(100, -1))
    undisturbed = _trainer(three).fit(Xd, yd)
    victim = sorted(workers_info(three))[1]

    def kill_after_first_segment(trainer, record):
        if record["step"] == 1:
            _kill(three, victim)

    disturbed = _trainer(three, callback=kill_after_first_segment).fit(Xd, yd)
    assert victim not in disturbed.shards_.placement.values()
    for a, b in zip(disturbed.model.parameters(), undisturbed.model.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-10,
                                   atol=1e-12)


def test_a_non_finite_error_leaves_nothing_on_the_workers(caplog):
    """After a fit and a NonFiniteError, the client holds no future of blockflow's (without
    a garbage collection: reference cycles kept the model scattered to every worker, which
    the scheduler logged as "lost scattered data" at shutdown)."""
    X, y = _data(4000, 8)
    was = gc.isenabled()
    gc.disable()
    try:
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          dashboard_address=None) as cluster, Client(cluster) as c:
            trainer = _trainer(c)
            trainer.fit(X, y)
            X[2500, 3] = np.nan
            with pytest.raises(NonFiniteError, match="row 2500"):
                trainer.fit(X, y)
            wait_until(lambda: not c.futures, timeout=scaled(10),
                       message=lambda: f"the client to release {sorted(c.futures)}")
            with caplog.at_level(logging.ERROR, logger="distributed.scheduler"):
                c.shutdown()
    finally:
        if was:
            gc.enable()
    assert not [r for r in caplog.records if "scattered data" in r.getMessage()]


def _warnings(caught) -> list[str]:
    from blockflow.errors import BlockflowWarning

    return [str(w.message) for w in caught if issubclass(w.category, BlockflowWarning)]


@pytest.mark.timeout(900)  # three worker processes killed and restarted: minutes loaded
def test_every_pipeline_entry_point_after_a_stage_was_rebuilt_on_a_survivor():
    """A stage's worker killed during fit (the stage rebuilt on a survivor), then another
    between calls: run() with and without a target, predict() and state_dict() go on from
    the checkpoint (one warning line per loss), equal to one process in float64."""
    import functools
    import threading
    import warnings

    from blockflow.ml.parallel import PipelineParallel

    rng = np.random.default_rng(1)
    X, T = rng.standard_normal((32, 6)), rng.standard_normal((32, 3))
    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).double()
    ref, initial = copy.deepcopy(model), copy.deepcopy(model)
    opt = sgd(ref.parameters())

    def step(lo, hi):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(torch.tensor(X[lo:hi])), torch.tensor(T[lo:hi]))
        loss.backward()
        opt.step()
        return loss.item()

    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = PipelineParallel(c, model, optimizer=sgd, partition="equal",
                                checkpoint_every=2)
        victim = pipe.stage_workers[2]

        def kill_at(epoch, step_, loss):
            if step_ == 2 and victim in workers_info(c):
                threading.Thread(target=_kill, args=(c, victim)).start()

        pipe.fit(X, T, epochs=1, batch_size=8, n_micro_batches=2, shuffle=False,
                 callback=kill_at)
        for lo in range(0, 32, 8):
            step(lo, lo + 8)
        assert victim not in pipe.stage_workers and len(_warnings(caught)) == 1
        # bitwise the model of a fit that lost nothing, on another split and worker count:
        # each layer computes the same micro-batches, the schedule adds them in its order
        plain = PipelineParallel(c, initial, optimizer=sgd, partition="equal",
                                 checkpoint_every=2)
        plain.fit(X, T, epochs=1, batch_size=8, n_micro_batches=2, shuffle=False)
        assert len(plain.ranks) == 3 and len(pipe.ranks) == 2
        want = plain.state_dict()
        for n, v in pipe.state_dict().items():  # bitwise in quiet runs; once under load not
            assert torch.allclose(v, want[n], rtol=0, atol=1e-10), n
        # run() after the rebuild: one training step, then a forward pass
        got = pipe.run(X[:8], T[:8], n_micro_batches=2, publish=False)
        assert abs(got.loss - step(0, 8)) < 1e-10
        out = pipe.run(X, n_micro_batches=2, publish=False).output
        np.testing.assert_allclose(out, ref(torch.tensor(X)).detach().numpy(), atol=1e-10)
        # a stage's worker gone between calls: the next call re-places on the one left
        _kill(c, pipe.stage_workers[-1])
        np.testing.assert_allclose(pipe.predict(X, n_micro_batches=2),
                                   ref(torch.tensor(X)).detach().numpy(), atol=1e-10)
        assert len(pipe.ranks) == 1
        got = pipe.run(X[8:16], T[8:16], n_micro_batches=2, publish=False)
        assert abs(got.loss - step(8, 16)) < 1e-10
        state = pipe.state_dict()
        for n, v in ref.state_dict().items():
            assert float((state[n] - v).abs().max()) < 1e-10, n
        lines = _warnings(caught)
        assert len(lines) == 2 and all(
            "\n" not in w and w.startswith("blockflow: the pipeline lost worker")
            for w in lines), lines


@pytest.mark.timeout(900)  # worker processes killed and restarted: minutes loaded
def test_every_tensor_parallel_entry_point_after_a_shard_s_worker_left_between_calls():
    """forward (and predict) and gradients after the worker of a shard left between calls
    (fit: test_tensor_parallel.py): each re-places the model from the checkpoint with one
    warning line naming the shard; as many ranks on other workers give the same bits, and
    one process's values in float64."""
    import functools
    import warnings

    from blockflow.ml.parallel import TensorParallel

    torch.manual_seed(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.GELU(),
                              torch.nn.Linear(8, 4)).double()
    ref = copy.deepcopy(mlp)
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((40, 5)), rng.standard_normal((40, 4))
    sgd = functools.partial(torch.optim.SGD, lr=0.01)
    mse = torch.nn.MSELoss()
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp = TensorParallel(c, mlp, optimizer=sgd)
        tp.fit(X, Y, batch_size=20)
        o = sgd(ref.parameters())
        for lo in (0, 20):
            o.zero_grad()
            mse(ref(torch.tensor(X[lo:lo + 20])), torch.tensor(Y[lo:lo + 20])).backward()
            o.step()
        want = ref(torch.tensor(X)).detach()
        before = tp.forward(X)
        for n, call in enumerate(("forward", "gradients")):
            victim = tp.workers[n % len(tp.workers)]
            _kill(c, victim)
            if call == "forward":  # as many ranks on other workers: bitwise the same
                out = tp.forward(X)
                assert len(tp.workers) == 2 and torch.equal(out, before)
                assert float((out - want).abs().max()) < 1e-10
                np.testing.assert_array_equal(tp.predict(X), out.numpy())
            else:
                got = tp.gradients(X, Y)
                ref.zero_grad()
                loss = mse(ref(torch.tensor(X)), torch.tensor(Y))
                loss.backward()
                assert abs(got["loss"] - loss.item()) < 1e-10
                for name, p in ref.named_parameters():
                    assert float((got["grads"][name] - p.grad).abs().max()) < 1e-10, name
            lines = _warnings(caught)
            assert len(lines) == n + 1 and re.fullmatch(
                rf"blockflow: TensorParallel [a-z ]+: lost rank \d's shard \(hidden columns "
                rf"\d-\d of the module\) on worker {re.escape(victim)}; re-placed on 2 "
                rf"worker\(s\) from the checkpoint of step 2\.", lines[-1]), lines
