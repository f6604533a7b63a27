"""Tensor parallelism on torch's tensor-parallel API (DeviceMesh, parallelize_module) over
groups blockflow places on worker processes: float64 forward, gradients and 20 training
steps equal one process's (MLP block; attention and MLP blocks in a small model), the
checkpoint carried between calls, the placement by free device memory, lost workers named
in one line, bfloat16, refused modules."""

from __future__ import annotations

import copy
import functools
import os
import re
import signal
import threading
import warnings

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

import blockflow
from blockflow.errors import BlockflowWarning, WorkerLostError
from blockflow.ml.parallel import TensorParallel
from blockflow.scheduling.view import workers_info
from blockflow.testing import simulated_cluster
from loadaware import scaled, wait_until

torch = pytest.importorskip("torch")

TOL = 1e-10

pytestmark = pytest.mark.slow  # worker processes: torch's group is one per process


def max_diff(a, b) -> float:
    return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())


@pytest.fixture(scope="module")
def procs():
    """Two worker processes of one thread (one rank each)."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


def _kill(client, worker):
    """End ``worker``'s process at once (its nanny starts a new one at another address)."""
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)


def _mlp(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.GELU(),
                               torch.nn.Linear(8, 4)).double()


def _data(rows=40, d_in=5, d_out=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, d_in)), rng.standard_normal((rows, d_out))


def _train_one_process(model, X, Y, steps_per_epoch, epochs, optimizer, loss):
    """The same steps in this process: losses, gradients at the end."""
    opt = optimizer(model.parameters())
    size = len(X) // steps_per_epoch
    losses = []
    for _ in range(epochs):
        for s in range(0, len(X), size):
            opt.zero_grad()
            out = loss(model(torch.tensor(X[s:s + size])), torch.tensor(Y[s:s + size]))
            out.backward()
            opt.step()
            losses.append(out.item())
    return losses


def _grads(model, X, Y, loss):
    model.zero_grad()
    out = loss(model(torch.tensor(X)), torch.tensor(Y))
    out.backward()
    return out.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_mlp_block_forward_gradients_and_20_steps_equal_one_process(procs):
    mlp = _mlp()
    ref = copy.deepcopy(mlp)
    X, Y = _data()
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    mse = torch.nn.MSELoss()
    tp = TensorParallel(procs, mlp, optimizer=sgd)
    assert len(tp.workers) == 2 and tp.blocks == {"": "mlp"}
    assert list(tp.widths.values()) == [{"": 4}, {"": 4}]  # torch's even shards
    assert max_diff(tp.forward(torch.tensor(X)), ref(torch.tensor(X)).detach()) < TOL
    got, (loss, grads) = tp.gradients(X, Y), _grads(ref, X, Y, mse)
    assert abs(got["loss"] - loss) < TOL and set(got["grads"]) == set(grads)
    for n in grads:
        assert max_diff(got["grads"][n], grads[n]) < TOL, n
    # 20 steps in two calls: the momentum buffers carried between them on the workers
    tp.fit(X, Y, epochs=2, batch_size=10)
    tp.fit(X, Y, epochs=3, batch_size=10)
    want = _train_one_process(ref, X, Y, 4, 5, sgd, mse)
    assert tp.steps_ == 20 and np.abs(np.subtract(tp.history_, want)).max() < TOL
    state = tp.state_dict()
    for n, p in ref.state_dict().items():
        assert max_diff(state[n], p) < TOL, n
    got, (loss, grads) = tp.gradients(X, Y), _grads(ref, X, Y, mse)
    assert abs(got["loss"] - loss) < TOL
    for n in grads:
        assert max_diff(got["grads"][n], grads[n]) < TOL, n
    assert tp.predict(X).shape == (40, 4)
    # dask arrays: computed on the cluster, the same steps
    other = TensorParallel(procs, _mlp(), optimizer=sgd)
    other.fit(da.from_array(X, chunks=15), da.from_array(Y, chunks=15), epochs=5,
              batch_size=10)
    assert np.abs(np.subtract(other.history_, want)).max() < TOL


class _Small(torch.nn.Module):
    """A residual attention block with LayerNorm, an MLP block, a head: both blocks
    sharded, the rest replicated."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(3, 8)
        self.attn = torch.nn.MultiheadAttention(8, 4, batch_first=True)
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 8))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h + self.mlp(h)).mean(1)


def test_attention_and_mlp_blocks_in_a_model_train_as_one_process(procs):
    torch.manual_seed(2)
    model = _Small().double()
    ref = copy.deepcopy(model)
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((20, 5, 3)), rng.standard_normal((20, 2))
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    mse = torch.nn.MSELoss()
    tp = TensorParallel(procs, model, optimizer=adam)
    assert tp.blocks == {"attn": "attention", "mlp": "mlp"}
    assert list(tp.widths.values()) == [{"attn": 2, "mlp": 8}] * 2
    assert max_diff(tp.forward(X), ref(torch.tensor(X)).detach()) < TOL
    got, (loss, grads) = tp.gradients(X, Y), _grads(ref, X, Y, mse)
    assert abs(got["loss"] - loss) < TOL and set(got["grads"]) == set(grads)
    for n in grads:
        assert max_diff(got["grads"][n], grads[n]) < TOL, n
    tp.fit(X, Y, epochs=5, batch_size=5)  # Adam's moments (sharded DTensors) carried over
    tp.fit(X, Y, epochs=5, batch_size=5)
    want = _train_one_process(ref, X, Y, 4, 10, adam, mse)
    assert np.abs(np.subtract(tp.history_, want)).max() < TOL
    state = tp.state_dict()
    assert set(state) == set(ref.state_dict())
    for n, p in ref.state_dict().items():
        assert max_diff(state[n], p) < TOL, n


def test_a_transformer_layer_with_its_attention_sharded_equals_the_layer(procs):
    torch.manual_seed(4)
    layer = torch.nn.TransformerEncoderLayer(8, 4, 16, dropout=0.0, batch_first=True,
                                             dtype=torch.float64)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    tp = TensorParallel(procs, layer)
    assert tp.blocks == {"self_attn": "attention"}
    assert max_diff(tp.forward(x), layer.eval()(x).detach()) < TOL


def test_a_bfloat16_model_trains_and_keeps_its_dtype(procs):
    mlp = _mlp().to(torch.bfloat16)
    X, Y = _data()
    tp = TensorParallel(procs, mlp)
    tp.fit(torch.tensor(X, dtype=torch.bfloat16), Y, epochs=1, batch_size=20)
    assert len(tp.history_) == 2 and np.isfinite(tp.history_).all()
    assert all(t.dtype == torch.bfloat16 for t in tp.state_dict().values())
    assert tp.forward(X).dtype == torch.bfloat16
    assert tp.predict(X).dtype == np.float32


def test_bad_modules_and_arguments_are_refused_in_one_line(procs):
    with pytest.raises(TypeError, match=r"^blockflow: TensorParallel splits an MLP block "
                                        r"Sequential\(Linear, <element-wise activation>, "
                                        r"Linear\) or an nn.MultiheadAttention, or a model "
                                        r"holding them; got Sequential with none\.$"):
        TensorParallel(procs, torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Dropout(),
                                                  torch.nn.Linear(3, 2)))
    with pytest.raises(TypeError, match=r"dropout=0 \(attention 'module'\)\.$"):
        TensorParallel(procs, torch.nn.MultiheadAttention(8, 2, dropout=0.1,
                                                          batch_first=True))
    tp = TensorParallel(procs, _mlp())
    X, Y = _data()
    X[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"^blockflow: TensorParallel: X has 1 non-finite"):
        tp.fit(X, Y)
    with pytest.raises(ValueError, match=r"X has 40 rows but y has 39\.$"):
        tp.fit(_data()[0], Y[:39])


def test_placement_keeps_the_workers_whose_free_memory_fits_the_even_shard():
    """12 hidden columns: over 3 workers each holds 4, over 2 each 6. The third worker's
    memory fits neither, so the even shard goes over the two that fit it; on the small
    worker alone the refusal names the shortfall."""
    torch.manual_seed(3)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 12), torch.nn.ReLU(),
                              torch.nn.Linear(12, 32)).double()
    total = sum(p.numel() * 8 for p in mlp.parameters())
    half = total - 12 * 65 * 8 + 6 * 65 * 8
    memory = [int(half / 0.8 * 1.05)] * 2 + [int((total - 12 * 65 * 8 + 4 * 65 * 8) / 0.8 * 0.9)]
    with simulated_cluster(speeds=(1, 1, 1), device_memory=memory) as c:
        by_name = {info["name"]: a for a, info in workers_info(c).items()}
        tp = TensorParallel(c, mlp)
        assert tp.workers == sorted([by_name[0], by_name[1]])
        assert tp.shard_bytes == half and list(tp.widths.values()) == [{"": 6}] * 2
        with pytest.raises(blockflow.DeviceMemoryError, match=(
                rf"^blockflow: TensorParallel: an even shard over 1 worker\(s\) takes "
                rf"{total:,} bytes of parameters but the most free device memory is [\d,]+ "
                rf"bytes on {re.escape(by_name[2])} \(memory fraction 0\.8\): short by "
                rf"[\d,]+ bytes; add workers or devices, or use a smaller model\.$")):
            TensorParallel(c, mlp, workers=[by_name[2]])


def test_a_worker_lost_between_calls_or_during_one_is_named_and_training_resumes():
    """A rank's worker killed between two fit calls, then during one: each time one warning
    line names the shard and its worker, the model is re-placed on the workers left from the
    checkpoint kept on the workers, and the losses and parameters equal one process's."""
    mlp = _mlp()
    ref = copy.deepcopy(mlp)
    X, Y = _data()
    sgd = functools.partial(torch.optim.SGD, lr=0.01)
    mse = torch.nn.MSELoss()
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp = TensorParallel(c, mlp, optimizer=sgd)
        assert len(tp.workers) == 2  # 8 columns do not split evenly over 3
        tp.fit(X, Y, epochs=1, batch_size=10)
        victim = tp.workers[1]
        _kill(c, victim)
        wait_until(lambda: victim not in workers_info(c), timeout=scaled(60))
        tp.fit(X, Y, epochs=1, batch_size=10)  # re-placed; resumes from step 4
        lines = [str(w.message) for w in caught if issubclass(w.category, BlockflowWarning)]
        assert len(lines) == 1 and re.fullmatch(
            rf"blockflow: TensorParallel training: lost rank 1's shard \(hidden columns 4-7 "
            rf"of the module\) on worker {re.escape(victim)}; re-placed on [12] worker\(s\) "
            rf"from the checkpoint of step 4\.", lines[0]), lines
        assert victim not in tp.workers and tp.recoveries == []

        # during a call: the rank's worker leaves while the group trains (2,000 steps)
        Xl, Yl = np.tile(X, (100, 1)), np.tile(Y, (100, 1))
        runner = threading.Thread(target=tp.fit, args=(Xl, Yl), kwargs={"batch_size": 2})
        runner.start()
        wait_until(lambda: sum(len(v) for v in c.processing(tp.workers).values()) ==
                   len(tp.workers), timeout=scaled(60))
        victim = tp.workers[0]
        _kill(c, victim)
        runner.join(scaled(300))
        assert not runner.is_alive()
        lines = [str(w.message) for w in caught if issubclass(w.category, BlockflowWarning)]
        assert len(lines) == 2 and re.fullmatch(
            rf"blockflow: TensorParallel training: lost rank 0's shard \(hidden columns "
            rf"0-[37] of the module\) on worker {re.escape(victim)}; re-placed on [12] "
            rf"worker\(s\) from the checkpoint of step 8\.", lines[1]), lines
        assert tp.recoveries == [{"step": 8, "resumed_from": 8, "lost": [victim],
                                  "redone": 2000}]
        want = _train_one_process(ref, X, Y, 4, 2, sgd, mse)
        want += _train_one_process(ref, Xl, Yl, 2000, 1, sgd, mse)
        assert tp.steps_ == 2008 and np.abs(np.subtract(tp.history_, want)).max() < TOL
        state = tp.state_dict()
        for n, p in ref.state_dict().items():
            assert max_diff(state[n], p) < TOL, n

        # nothing left to take the model: the one chosen worker is lost
        only = TensorParallel(c, _mlp(), workers=[tp.workers[0]])
        only.fit(X, Y, batch_size=20)
        _kill(c, only.workers[0])
        wait_until(lambda: only.workers[0] not in workers_info(c), timeout=scaled(60))
        with pytest.raises(WorkerLostError, match=(
                rf"^blockflow: TensorParallel forward pass: lost rank 0's shard \(hidden "
                rf"columns 0-7 of the module\) on worker {re.escape(only.workers[0])}, and "
                rf"the workers left cannot take the model: no workers to place the model "
                rf"on\.$")):
            only.forward(X)


@pytest.mark.gpu
def test_tensor_parallel_on_cuda_workers_equals_the_cpu_model():
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with CUDA and an NVIDIA GPU")
    mlp = _mlp()
    X, _ = _data()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        tp = TensorParallel(c, mlp)
        assert max_diff(tp.forward(X).cpu(), mlp(torch.tensor(X)).detach()) < 1e-9
