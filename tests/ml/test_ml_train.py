"""Data-parallel training (blockflow.ml.DataParallelTrainer): torch DDP on blockflow's ranks.

The reference is a plain single-process PyTorch loop over the same batches
(:func:`blockflow.ml.batch_schedule`); the clusters are real worker processes (one
torch.distributed rank each), nothing of Dask or torch is mocked.
"""

from __future__ import annotations

import functools
import os
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from blockflow.errors import NonFiniteError  # noqa: E402
from blockflow.ml import DataParallelTrainer, batch_schedule  # noqa: E402
from blockflow.scheduling.view import workers_info  # noqa: E402

#: uneven blocks: the workers hold different numbers of rows
CHUNKS = (100, 300, 50, 150, 200, 97, 250, 100, 100)


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    return train_test_split(X / 16.0, y, test_size=0.25, random_state=0)


@pytest.fixture(scope="module")
def client3():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10)).to(dtype)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def collections(Xtr, ytr, chunks=CHUNKS):
    return da.from_array(Xtr, chunks=(chunks, -1)), da.from_array(ytr, chunks=(chunks,))


def params(model) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().double().numpy()


def single_process(model, X, y, block_rows, batch_size, epochs, seed):
    """Plain PyTorch on one process, same batches: the reference loss curve."""
    opt = adam(list(model.parameters()))
    offsets = np.concatenate([[0], np.cumsum(block_rows)])
    losses = []
    for epoch in range(epochs):
        for rows in batch_schedule(block_rows, batch_size, epoch, seed):
            idx = np.concatenate([offsets[j] + r for j, r in enumerate(rows)])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.as_tensor(X[idx])),
                                                     torch.as_tensor(y[idx]))
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return np.array(losses)


def test_batch_schedule_takes_every_row_once_per_epoch():
    rows = [100, 100, 37, 250]
    seen = [np.concatenate(parts) for parts in zip(*batch_schedule(rows, 64, 3, seed=1))]
    for r, s in zip(rows, seen):
        assert sorted(s) == list(range(r))
    a = [np.concatenate(b) for b in batch_schedule(rows, 64, 0, seed=1)]
    b = [np.concatenate(b) for b in batch_schedule(rows, 64, 0, seed=1)]
    c = [np.concatenate(b) for b in batch_schedule(rows, 64, 0, seed=2)]
    assert all((x == z).all() for x, z in zip(a, b))
    assert any(len(x) != len(z) or (x != z).any() for x, z in zip(a, c))
    sizes = [sum(len(p) for p in parts) for parts in batch_schedule(rows, 64, 0)]
    assert max(sizes) - min(sizes) <= len(rows) and sum(sizes) == sum(rows)


@pytest.mark.parametrize("block, n, batch", [(1, 200, 64), (7, 1797, 10), (3, 90, 8)])
def test_batch_schedule_spreads_blocks_smaller_than_the_steps(block, n, batch):
    """Blocks of fewer rows than an epoch has steps: every block used to cut at the same
    points, so most steps got no row and one got them all."""
    rows = [block] * (n // block) + ([n % block] if n % block else [])
    for epoch in range(3):
        steps = list(batch_schedule(rows, batch, epoch, seed=0))
        sizes = [sum(len(p) for p in parts) for parts in steps]
        assert len(sizes) == -(-n // batch) and sum(sizes) == n
        assert min(sizes) > 0, sizes
        assert max(sizes) <= 3 * batch, sizes
        for j, r in enumerate(rows):  # each block's rows once per epoch
            assert sorted(np.concatenate([parts[j] for parts in steps])) == list(range(r))


@pytest.mark.parametrize("sharding", ["speed", "equal"])
def test_ddp_on_three_workers_equals_single_process_training(client3, digits, sharding):
    """float64: every step's loss and the final parameters within 1e-10 of one process,
    on uneven blocks (the ranks' local batches differ; the loss weights make DDP's mean
    the global batch's), over several segments (checkpoints restored in between)."""
    Xtr, Xte, ytr, yte = digits
    model, reference = mlp(), mlp()
    trainer = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(), adam, batch_size=128,
                                  epochs=3, seed=3, client=client3, sharding=sharding,
                                  checkpoint_every=7)
    trainer.fit(*collections(Xtr, ytr))
    expected = single_process(reference, Xtr, ytr, trainer.shards_.block_rows, 128, 3, 3)
    got = trainer.loss_curve()
    assert len(got) == len(expected) == 3 * 11
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(params(model), params(reference), rtol=1e-10, atol=1e-12)
    assert len({r["segment"] for r in trainer.history_}) >= 5
    # a rank per worker holding blocks (three with equal shares; speed-weighted shares may
    # leave a worker measured slow on a loaded machine without blocks), each on its rows
    rows = trainer.history_[-1]["worker_rows"]
    assert set(rows) == set(trainer.shards_.rows_per_worker())
    assert len(rows) == 3 if sharding == "equal" else len(rows) >= 2
    assert sum(rows.values()) == trainer.history_[-1]["samples"]
    assert sum(trainer.shards_.rows_per_worker().values()) == len(Xtr)
    assert model[0].weight.dtype == torch.float64 and not trainer.fsdp_
    assert (model(torch.as_tensor(Xte)).argmax(1).numpy() == yte).mean() > 0.9


def test_two_fits_are_bitwise_equal(client3, digits):
    Xtr, _, ytr, _ = digits
    models = [mlp(2), mlp(2)]
    for m in models:
        DataParallelTrainer(m, torch.nn.CrossEntropyLoss(), adam, batch_size=200, epochs=1,
                            seed=1, client=client3, sharding="equal",
                            checkpoint_every=3).fit(*collections(Xtr, ytr))
    assert (params(models[0]) == params(models[1])).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_train_and_keep_their_dtype(client3, digits, dtype):
    """issue 39: bfloat16 could not cross distributed's serialisation; torch's own
    collectives carry it now."""
    Xtr, _, ytr, _ = digits
    model = mlp(0, dtype)
    # SGD: Adam's eps (1e-8) is 0 in float16
    trainer = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(),
                                  lambda ps: torch.optim.SGD(ps, lr=0.5), batch_size=256,
                                  epochs=2, client=client3, checkpoint_every=4)
    trainer.fit(*collections(Xtr, ytr))
    assert all(p.dtype == dtype for p in model.parameters())
    curve = trainer.loss_curve()
    assert np.isfinite(curve).all() and curve[-1] < curve[0], curve


def test_fsdp2_shards_the_model_and_trains_as_ddp(client3, digits):
    """FSDP2 (``fully_shard``) on CPU with gloo: the same steps as one process (float64)."""
    Xtr, _, ytr, _ = digits
    model, reference = mlp(4), mlp(4)
    trainer = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(), adam, batch_size=256,
                                  epochs=1, seed=2, client=client3, fsdp=True,
                                  checkpoint_every=3)
    trainer.fit(*collections(Xtr, ytr))
    assert trainer.fsdp_
    expected = single_process(reference, Xtr, ytr, trainer.shards_.block_rows, 256, 1, 2)
    np.testing.assert_allclose(trainer.loss_curve(), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(params(model), params(reference), rtol=1e-10, atol=1e-12)


def test_fsdp2_is_chosen_when_the_state_does_not_fit_the_smallest_worker(client3):
    from blockflow.ml.train import _state_bytes

    model = mlp()
    n = sum(p.numel() for p in model.parameters()) * 8
    assert _state_bytes(model, adam(list(model.parameters()))) == 4 * n
    assert _state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1)) == 2 * n
    assert _state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                               momentum=0.9)) == 3 * n

    class Shards:
        def rows_per_worker(self):
            return dict.fromkeys(workers_info(client3), 1)

    trainer = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(), memory_fraction=1e-9)
    assert trainer._needs_fsdp(client3, Shards(), adam(list(model.parameters())))
    trainer.memory_fraction = 0.5
    assert not trainer._needs_fsdp(client3, Shards(), adam(list(model.parameters())))


@pytest.mark.gpu
def test_a_gpu_worker_trains_with_nccl_and_the_client_model_stays_put(digits):
    """One rank per GPU worker: nccl, the blocks moved to the device once per segment; the
    client's model (on the CPU) gets the result, equal to one process on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    Xtr, _, ytr, _ = digits
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        model = mlp(3, torch.float32)
        trainer = DataParallelTrainer(model, torch.nn.CrossEntropyLoss(), adam,
                                      batch_size=128, epochs=2, seed=1, client=client,
                                      checkpoint_every=5)
        trainer.fit(*collections(Xtr, ytr))
    reference = mlp(3, torch.float32).cuda()
    opt = adam(list(reference.parameters()))
    off = np.concatenate([[0], np.cumsum(trainer.shards_.block_rows)])
    for epoch in range(2):
        for rows in batch_schedule(trainer.shards_.block_rows, 128, epoch, 1):
            idx = np.concatenate([off[j] + r for j, r in enumerate(rows)])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(
                reference(torch.as_tensor(Xtr[idx], dtype=torch.float32).cuda()),
                torch.as_tensor(ytr[idx]).cuda()).backward()
            opt.step()
    assert model[0].weight.device.type == "cpu"
    np.testing.assert_allclose(params(model), params(reference.cpu()), rtol=1e-4,
                               atol=1e-5)


def _slow_by_name(seconds, cpu_seconds, rows):
    """Worker named i runs at speed (1, 1, 0.25)[i]: 2 ms of reference work per row."""
    from distributed import get_worker
    time.sleep(rows * 2e-3 / (1, 1, 0.25)[int(get_worker().name)])


def test_shares_follow_simulated_speeds(client3, digits):
    """No speed is known: a short first segment measures each rank's own compute (the
    block hook runs before the rank waits on its peers), then blocks move so the slow
    worker's share (and local batch) shrinks."""
    Xtr, _, ytr, _ = digits
    trainer = DataParallelTrainer(mlp(), torch.nn.CrossEntropyLoss(), adam, batch_size=256,
                                  epochs=2, client=client3, checkpoint_every=4,
                                  block_hook=_slow_by_name)
    trainer.fit(*collections(Xtr, ytr, chunks=45))
    names = {a: int(w["name"]) for a, w in workers_info(client3).items()}
    rows = {names[a]: r for a, r in trainer.shards_.rows_per_worker().items()}
    first = {names[a]: r for a, r in trainer.history_[0]["worker_rows"].items()}
    last = {names[a]: r for a, r in trainer.history_[-1]["worker_rows"].items()}
    assert trainer.history_[0]["segment"] == 0 and trainer.history_[4]["segment"] == 1
    assert trainer.shards_.moves > 0
    # equal speeds would give 1:1:1; measured 4:4:1
    assert min(rows[0], rows[1]) > 2 * rows.get(2, 0), rows
    assert min(last[0], last[1]) > 2 * last.get(2, 0), (first, last)


def _kill_once(flag, seconds, cpu_seconds, rows):
    """Worker named 1 kills its own process on its 6th step (once: the flag file)."""
    from distributed import get_worker

    if get_worker().name != 1 or os.path.exists(flag):
        return
    _kill_once.calls = getattr(_kill_once, "calls", 0) + 1
    if _kill_once.calls == 6:
        open(flag, "w").close()
        os.kill(os.getpid(), 9)


@pytest.mark.slow
def test_killed_worker_mid_training_gives_the_same_parameters(digits, tmp_path):
    """A worker killed mid-segment: one warning naming it and the steps redone, the group
    re-formed on the survivors from the last checkpoint, the unfaulted run's parameters."""
    Xtr, _, ytr, _ = digits
    X, y = collections(Xtr, ytr)
    kw = dict(batch_size=128, epochs=2, seed=5, checkpoint_every=4)
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        undisturbed = mlp(1)
        DataParallelTrainer(undisturbed, torch.nn.CrossEntropyLoss(), adam, client=client,
                            **kw).fit(X, y)
        victim = next(a for a, w in workers_info(client).items() if w["name"] == 1)
        model = mlp(1)
        trainer = DataParallelTrainer(
            model, torch.nn.CrossEntropyLoss(), adam, client=client,
            block_hook=functools.partial(_kill_once, str(tmp_path / "killed")),
            checkpoint_path=str(tmp_path / "ckpt.pt"), **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(X, y)
    lines = [str(w.message) for w in caught if "lost worker" in str(w.message)]
    assert len(lines) == 1 and victim in lines[0] and "\n" not in lines[0], lines
    [rec] = trainer.recoveries_
    assert rec["lost"] == [victim] and rec["resumed_from"] % 4 == 0 and rec["redone"] <= 4
    assert [r["step"] for r in trainer.history_] == list(range(2 * 11))  # no step lost
    np.testing.assert_allclose(params(model), params(undisturbed), rtol=1e-10, atol=1e-12)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert saved["step"] == 22
    np.testing.assert_array_equal(saved["model"]["0.weight"].numpy(),
                                  model[0].weight.detach().numpy())


def test_a_non_finite_value_is_one_line_naming_block_and_row(client3, digits):
    Xtr, _, ytr, _ = digits
    X = Xtr.copy()
    X[437, 5] = np.nan  # block 2 of CHUNKS holds rows 400-449
    with pytest.raises(NonFiniteError) as e:
        DataParallelTrainer(mlp(), torch.nn.CrossEntropyLoss(), client=client3).fit(
            *collections(X, ytr))
    assert str(e.value) == (
        "blockflow: X has a non-finite value (nan) in column 5, row 437 (block 2): drop or "
        "impute such rows, or pass drop_nonfinite=True (setting blockflow.ml.drop-nonfinite) "
        "to leave them out.")


@pytest.mark.parametrize("kw, message", [
    (dict(batch_size=0), "batch_size must be an integer >= 1 (samples per step), got 0."),
    (dict(batch_size=2.5), "batch_size must be an integer >= 1 (samples per step), got 2.5."),
    (dict(batch_size=True), "batch_size must be an integer >= 1 (samples per step), got True."),
    (dict(epochs=0), "epochs must be an integer >= 1 (passes over the rows), got 0."),
    (dict(seed=-1), "seed must be an integer >= 0 (seed of the batch schedule), got -1."),
    (dict(memory_fraction=0), "memory_fraction must be a finite number > 0 and <= 1 "
                              "(fraction of a worker's free memory its blocks may take), "
                              "got 0."),
    (dict(memory_fraction=float("nan")), "memory_fraction must be a finite number > 0 and "
                                         "<= 1 (fraction of a worker's free memory its "
                                         "blocks may take), got nan."),
    (dict(checkpoint_every=0), "checkpoint_every must be an integer >= 1 (or None) (steps "
                               "between checkpoints), got 0."),
    (dict(sharding="fast"), "sharding must be 'speed' or 'equal', got 'fast'."),
    (dict(fsdp="yes"), "fsdp must be True, False or None (automatic), got 'yes'."),
])
def test_bad_trainer_arguments_are_refused_before_anything_runs(kw, message):
    with pytest.raises(ValueError) as e:
        DataParallelTrainer(mlp(), torch.nn.CrossEntropyLoss(), **kw)
    assert str(e.value) == "blockflow.ml.DataParallelTrainer: " + message


@pytest.mark.parametrize("kw, message", [
    (dict(optimizer=0.01), "optimizer must be callable, got builtins.float."),
    (dict(checkpoint_path=3), "checkpoint_path must be a file path, got builtins.int."),
])
def test_a_trainer_argument_of_the_wrong_type_is_refused(kw, message):
    with pytest.raises(TypeError) as e:
        DataParallelTrainer(mlp(), torch.nn.CrossEntropyLoss(), **kw)
    assert str(e.value) == "blockflow.ml.DataParallelTrainer: " + message
