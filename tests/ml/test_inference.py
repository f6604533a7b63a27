"""blockflow.predict on real clusters: models trained here on scikit-learn's bundled digits,
shipped once per worker, batches sized to free (simulated) device memory, results equal to
the model applied to the whole data."""

from __future__ import annotations

import copy

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster

import blockflow
from blockflow.ml.inference import model_stats, ship_model

sklearn = pytest.importorskip("sklearn")
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402

from blockflow.scheduling.view import workers_info


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    model = LogisticRegression(max_iter=300).fit(X[:1200], y[:1200])
    return X, y, model


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def test_array_equals_model_on_whole_data_with_chunks_and_meta(client, digits):
    X, _, model = digits
    x = da.from_array(X, chunks=(150, 16))  # features split: predict makes them one block
    labels = blockflow.predict(model, x)
    assert labels.chunks == (x.chunks[0],)
    assert labels.dtype == model.predict(X[:2]).dtype
    assert type(labels._meta) is np.ndarray and labels._meta.ndim == 1
    np.testing.assert_array_equal(labels.compute(), model.predict(X))

    proba = blockflow.predict(model, x, method="predict_proba")
    assert proba.chunks == (x.chunks[0], (10,))
    np.testing.assert_allclose(proba.compute(), model.predict_proba(X), rtol=1e-12)
    assert proba.name.startswith("blockflow-predict")


def test_model_is_shipped_once_per_worker_not_once_per_block(client, digits):
    X, _, model = digits
    model = LogisticRegression(max_iter=300, C=0.5).fit(X[:900], digits[1][:900])  # fresh
    ref = ship_model(model, client=client)
    n_blocks = 40
    x = da.from_array(X, chunks=(-(-len(X) // n_blocks), 64))
    out = blockflow.predict(model, x).compute()
    np.testing.assert_array_equal(out, model.predict(X))

    stats = model_stats(client, ref)
    payload = _payload_bytes(model)
    n_workers = len(workers_info(client))
    assert len(stats) == n_workers
    # Each worker received the model's bytes exactly once and deserialised it once.
    assert sum(s["bytes_received"] for s in stats.values()) == n_workers * payload
    assert all(s["loads"] <= 1 for s in stats.values())
    assert sum(s["blocks"] for s in stats.values()) == x.numblocks[0]
    # The tasks carry a reference, not the model: each task is far smaller than the model.
    from distributed.protocol.pickle import dumps

    graph = dict(blockflow.predict(model, x).__dask_graph__())
    task_bytes = max(len(dumps(t)) for k, t in graph.items() if "predict" in str(k))
    assert task_bytes < payload / 2


def _payload_bytes(model) -> int:
    import cloudpickle

    return len(cloudpickle.dumps(model))


def test_dataframe_and_xarray(client, digits):
    X, _, model = digits
    cols = [f"px{i}" for i in range(64)]
    pdf = pd.DataFrame(X, columns=cols, index=pd.RangeIndex(1000, 1000 + len(X)))
    pdf["extra"] = "not a feature"
    ddf = dd.from_pandas(pdf, npartitions=6)
    s = blockflow.predict(model, ddf, columns=cols)
    assert isinstance(s, dd.Series) and s.name == "prediction" and s.npartitions == 6
    got = s.compute()
    pd.testing.assert_index_equal(got.index, pdf.index)
    np.testing.assert_array_equal(got.to_numpy(), model.predict(X))

    p = blockflow.predict(model, ddf, columns=cols, method="predict_proba", output_name="p")
    assert list(p.columns) == [f"p_{i}" for i in range(10)]
    np.testing.assert_allclose(p.compute().to_numpy(), model.predict_proba(X), rtol=1e-12)

    xr = pytest.importorskip("xarray")
    arr = xr.DataArray(X, dims=("sample", "pixel"),
                       coords={"sample": np.arange(len(X)) * 2}).chunk({"sample": 300})
    out = blockflow.predict(model, arr, method="predict_proba")
    assert out.dims == ("sample", "output") and out.chunks[0] == arr.chunks[0]
    res = out.compute()
    np.testing.assert_array_equal(res["sample"].values, np.arange(len(X)) * 2)
    np.testing.assert_allclose(res.values, model.predict_proba(X), rtol=1e-12)


@pytest.mark.slow
def test_torch_module(client, digits):
    torch = pytest.importorskip("torch")
    X, y, _ = digits
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                              torch.nn.Dropout(0.5), torch.nn.Linear(32, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    xt, yt = torch.as_tensor(X, dtype=torch.float32), torch.as_tensor(y)
    for _ in range(30):  # a real (small) training run
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xt), yt).backward()
        opt.step()
    assert net.training  # predict must not switch the user's model to eval mode
    out = blockflow.predict(net, da.from_array(X, chunks=(400, 64)))
    assert out.dtype == np.float32 and out.chunks[1] == (10,)
    got = out.compute()
    assert net.training
    net.eval()
    with torch.no_grad():
        want = net(xt).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got.argmax(1) == y).mean() > 0.9


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_torch_modules_of_every_training_dtype_predict_their_own_values(client, digits,
                                                                       dtype):
    """bfloat16 outputs come back as float32 (NumPy has no bfloat16; float32 holds each
    value exactly); float16 and float64 keep their dtype. Inputs take the model's dtype."""
    torch = pytest.importorskip("torch")
    X, _, _ = digits
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(),
                              torch.nn.Linear(16, 3)).to(getattr(torch, dtype))
    got = blockflow.predict(net, da.from_array(X, chunks=(400, 64))).compute()
    with torch.no_grad():
        want = net(torch.as_tensor(X).to(getattr(torch, dtype))).float().numpy()
    assert got.dtype == (np.float32 if dtype == "bfloat16" else np.dtype(dtype))
    np.testing.assert_array_equal(got.astype(np.float32), want)


def _onnx_logistic(model):
    """The fitted logistic regression as an ONNX graph (Gemm + Softmax), batch dim free."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    W = numpy_helper.from_array(model.coef_.T.astype(np.float32), "W")
    b = numpy_helper.from_array(model.intercept_.astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["z"]),
         helper.make_node("Softmax", ["z"], ["p"], axis=1)],
        "logistic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [None, 10])],
        initializer=[W, b])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def test_onnx_model(client, digits):
    pytest.importorskip("onnxruntime")
    X, _, model = digits
    out = blockflow.predict(_onnx_logistic(model), da.from_array(X, chunks=(500, 64)))
    assert out.dtype == np.float32 and out.chunks[1] == (10,)
    np.testing.assert_allclose(out.compute(), model.predict_proba(X), rtol=1e-4, atol=1e-6)


def test_batches_fit_free_simulated_device_memory(digits):
    from blockflow.testing import simulated_cluster

    X, _, model = digits
    with simulated_cluster(speeds=(1, 1), device_memory="2MiB", processes=False) as c:
        ref = ship_model(model, client=c)
        x = da.from_array(X, chunks=(600, 64))
        np.testing.assert_array_equal(blockflow.predict(model, x, client=c).compute(),
                                      model.predict(X))
        stats = model_stats(c, ref)
    row_bytes = 64 * 8 + 8
    ran = [s for s in stats.values() if s["blocks"]]
    assert sum(s["blocks"] for s in ran) == 3
    for s in ran:
        # The budget is a fraction of the (simulated) free device memory, and the batches
        # stay within it: more batches than blocks.
        assert 0 < s["batch_budget"] <= 0.5 * 2 * 2**20
        assert s["max_batch_rows"] * row_bytes * 4 <= s["batch_budget"]
        assert s["batches"] > s["blocks"]
    # An explicit batch size wins.
    out = blockflow.predict(model, da.from_array(X, chunks=(600, 64)), batch_size=7)
    np.testing.assert_array_equal(out.compute(scheduler="sync"), model.predict(X))


def test_local_scheduler_without_cluster(digits):
    X, _, model = digits
    out = blockflow.predict(model, da.from_array(X, chunks=(500, 64)), client=False)
    np.testing.assert_array_equal(out.compute(scheduler="sync"), model.predict(X))


def test_bad_input_messages(client, digits):
    X, _, model = digits
    with pytest.raises(ValueError, match=r"^blockflow.predict: data must be 2-d \(samples, "
                                         r"features\), got 3-d"):
        blockflow.predict(model, da.zeros((4, 4, 4), chunks=2))
    with pytest.raises(TypeError, match=r"^blockflow.predict: data must be a dask array, a "
                                        r"dask DataFrame or a dask-backed xarray.DataArray, "
                                        r"got"):
        blockflow.predict(model, X)
    with pytest.raises(TypeError, match=r"^blockflow.predict: cannot run a"):
        blockflow.predict(object(), da.from_array(X))
    with pytest.raises(TypeError, match=r"has no method 'decision_path'"):
        blockflow.predict(model, da.from_array(X), method="decision_path")


@pytest.mark.gpu
def test_torch_module_on_cupy_blocks(client, digits):
    """On a GPU: CuPy blocks in, the model on the device, CuPy blocks out."""
    from conftest import requires_gpu  # guarded device count: 0, never an error

    if requires_gpu.args[0]:
        pytest.skip(requires_gpu.kwargs["reason"])
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of PyTorch")
    import cupy

    X, _, _ = digits
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 10))
    x = da.from_array(X.astype(np.float32), chunks=(500, 64)).map_blocks(cupy.asarray)
    out = blockflow.predict(net, x).compute()
    assert isinstance(out, cupy.ndarray)
    with torch.no_grad():
        want = net(torch.as_tensor(X, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(cupy.asnumpy(out), want, rtol=1e-4, atol=1e-5)


# --- empty partitions: no model call, outputs shaped and typed like the others -------------


class NoEmptyBatches:
    """A callable model that refuses an empty batch, as scikit-learn does."""

    def __call__(self, batch):
        if len(batch) == 0:
            raise ValueError("Found array with 0 sample(s)")
        return batch[:, :3] * 2.0


def _models_and_methods(digits):
    """(label, model, method, reference function) for every model kind and method."""
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler

    X, _, model = digits
    cases = [(f"estimator-{m}", model, m, getattr(model, m))
             for m in ("predict", "predict_proba", "decision_function", "predict_log_proba")]
    scaler, pca = StandardScaler().fit(X), PCA(3).fit(X)
    cases += [("estimator-transform", scaler, "transform", scaler.transform),
              ("pca-transform", pca, "transform", pca.transform),
              ("callable", NoEmptyBatches(), None, NoEmptyBatches())]
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 4), torch.nn.Softmax(dim=1)).eval()

    def run_net(a):
        with torch.no_grad():
            return net(torch.tensor(np.array(a), dtype=torch.float32)).numpy()

    cases.append(("torch", net, None, run_net))
    if _has("onnxruntime") and _has("onnx"):
        cases.append(("onnx", _onnx_logistic(model), None,
                      lambda a: model.predict_proba(a).astype(np.float32)))
    return cases


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_empty_array_blocks_return_empty_outputs_without_calling_the_model(client, digits):
    X = digits[0]
    # zero-row blocks, as a filter with compute_chunk_sizes() leaves them
    x = da.from_array(X, chunks=(300, 64)).rechunk(((0, 500, 0, 0, len(X) - 500), (64,)))
    keep = np.zeros(len(X), dtype=bool)
    keep[250:420] = True  # 3 of 18 blocks keep rows
    xf = da.from_array(X, chunks=(100, 64))[da.from_array(keep, chunks=100)]
    xf = xf.compute_chunk_sizes()
    assert 0 in xf.chunks[0] and 0 in x.chunks[0]
    for label, model, method, ref in _models_and_methods(digits):
        for data, rows in ((x, X), (xf, X[keep])):
            want = np.asarray(ref(rows))
            out = blockflow.predict(model, data, method=method)
            assert out.dtype == want.dtype, label
            assert out.chunks[0] == data.chunks[0], label
            got = out.compute()
            assert got.shape == want.shape and got.dtype == want.dtype, label
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=label)
            # each block alone: an empty one is (0, k) of the same dtype
            empty = out.blocks[0].compute()
            assert empty.shape == (0, *want.shape[1:]) and empty.dtype == want.dtype, label


def test_empty_partitions_of_a_filtered_dataframe(client, digits):
    X = digits[0]
    cols = [f"px{i}" for i in range(64)]
    pdf = pd.DataFrame(X, columns=cols)
    pdf["part"] = np.arange(len(X)) // 300
    ddf = dd.from_pandas(pdf, npartitions=6)
    kept = ddf[ddf["part"] == 2]  # five of six partitions empty
    rows = pdf[pdf["part"] == 2]
    assert sum(len(p) == 0 for p in kept.to_delayed() for p in [p.compute()]) == 5
    for label, model, method, ref in _models_and_methods(digits):
        want = np.asarray(ref(rows[cols].to_numpy()))
        out = blockflow.predict(model, kept, columns=cols, method=method, output_name="y")
        got = out.compute()
        if want.ndim == 1:
            assert isinstance(got, pd.Series) and got.dtype == want.dtype, label
            assert out._meta.dtype == want.dtype
        else:
            assert list(got.columns) == [f"y_{i}" for i in range(want.shape[1])], label
            assert (got.dtypes == want.dtype).all(), label
            assert list(out._meta.columns) == list(got.columns)
        pd.testing.assert_index_equal(got.index, rows.index)
        np.testing.assert_allclose(got.to_numpy(), want, rtol=1e-5, atol=1e-6, err_msg=label)
        first = out.partitions[0].compute()  # an empty partition: typed like the others
        assert len(first) == 0
        if want.ndim == 1:
            assert first.dtype == want.dtype and first.name == "y"
        else:
            assert list(first.columns) == list(got.columns)
            assert (first.dtypes == want.dtype).all()


def test_unknown_chunk_sizes_are_named_as_predicts_data(client, digits):
    X, _, model = digits
    x = da.from_array(X, chunks=(300, 64))
    with pytest.raises(ValueError, match=r"^blockflow.predict: data has unknown \(NaN\) chunk "
                                         r"sizes along axis 0; call x = "
                                         r"x.compute_chunk_sizes\(\) first"):
        blockflow.predict(model, x[x[:, 10] > 15])


# --- a model that cannot be pickled: one error, before anything is scheduled ----------------

LOCK_MESSAGE = (
    "{entry}: cannot ship the model to the workers: {path} is a _thread.lock that cannot be "
    "pickled (TypeError: cannot pickle '_thread.lock' object); {fix}.")


def _with_lock(model):
    import threading
    import types

    model = copy.deepcopy(model)
    model.transform_ = types.SimpleNamespace(fn=threading.Lock(), scale=2.0)
    return model


def _scheduled(client) -> tuple[list, list]:
    """Model plugins the scheduler keeps and tasks it knows: nothing after a refusal."""
    return client.run_on_scheduler(lambda dask_scheduler: (
        sorted(n for n in dask_scheduler.worker_plugins if n.startswith("blockflow-model")),
        list(dask_scheduler.tasks)))


def test_an_unpicklable_estimator_is_refused_before_anything_is_scheduled(client, digits):
    from blockflow.ml._pickling import FIX

    X, _, model = digits
    bad = _with_lock(model)
    before = _scheduled(client)
    with pytest.raises(TypeError) as e:
        blockflow.predict(bad, da.from_array(X, chunks=(500, 64)))
    assert str(e.value) == LOCK_MESSAGE.format(entry="blockflow.predict",
                                               path="model.transform_.fn", fix=FIX)
    assert FIX.startswith("give blockflow a factory that builds the model on the worker, or "
                          "its state_dict: blockflow.ml.inference.ModelFactory(build, "
                          "state_dict=model.state_dict())")
    with pytest.raises(TypeError) as e2:
        ship_model(bad, client=client)
    assert str(e2.value) == str(e.value)
    assert _scheduled(client) == before  # no plugin registered, no task submitted


def test_torch_modules_the_same_way_in_predict_and_training(client, digits):
    torch = pytest.importorskip("torch")
    import threading

    from blockflow.ml import DataParallelTrainer
    from blockflow.ml._pickling import FIX, FIX_TRAIN

    X, y, _ = digits
    net = torch.nn.Sequential(torch.nn.Linear(64, 10))
    net[0].guard = threading.Lock()  # an attribute of a sub-module
    x = da.from_array(X.astype(np.float32), chunks=(600, 64))
    yy = da.from_array(y, chunks=600)
    before = _scheduled(client)
    with pytest.raises(TypeError) as e:
        blockflow.predict(net, x)
    assert str(e.value) == LOCK_MESSAGE.format(entry="blockflow.predict", path="model.0.guard",
                                               fix=FIX)
    with pytest.raises(TypeError) as e:
        DataParallelTrainer(net, torch.nn.CrossEntropyLoss(), batch_size=64,
                            client=client).fit(x, yy)
    assert str(e.value) == LOCK_MESSAGE.format(
        entry="blockflow.ml.DataParallelTrainer.fit", path="model.0.guard", fix=FIX_TRAIN)
    assert _scheduled(client) == before

    # a lambda attribute ships by value (cloudpickle) in both, as distributed ships it
    del net[0].guard
    net.post = lambda t: t * 2
    want = net(torch.as_tensor(X[:5], dtype=torch.float32)).detach().numpy()
    np.testing.assert_allclose(blockflow.predict(net, x).compute()[:5], want, rtol=1e-5)
    trainer = DataParallelTrainer(net, torch.nn.CrossEntropyLoss(), batch_size=256,
                                  client=client, sharding="equal").fit(x, yy)
    assert np.isfinite(trainer.loss_curve()).all()


def _build_locked_net(seed):
    import threading

    import torch

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 10))
    net.guard = threading.Lock()  # built on the worker: never pickled
    return net


def test_a_model_factory_builds_the_model_on_each_worker(client, digits):
    torch = pytest.importorskip("torch")
    from blockflow.ml.inference import ModelFactory

    X = digits[0].astype(np.float32)
    trained = _build_locked_net(3)
    weights = {k: v * 0 + i for i, (k, v) in enumerate(trained.state_dict().items())}
    x = da.from_array(X, chunks=(600, 64))
    with ship_model(ModelFactory(_build_locked_net, 0, state_dict=weights),
                    client=client) as ref:
        got = blockflow.predict(ref, x).compute()
        stats = model_stats(client, ref)
    trained.load_state_dict(weights)
    with torch.no_grad():
        want = trained(torch.as_tensor(X)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert sum(s["loads"] for s in stats.values()) >= 1


# --- the worker-side cache: one copy, close(), a bound in bytes ------------------------------


def _fresh_model(digits, alpha):
    from sklearn.linear_model import RidgeClassifier  # closed form: quick, always converged

    X, y, _ = digits
    return RidgeClassifier(alpha=alpha).fit(X[:600], y[:600])


def test_a_worker_holds_one_copy_and_close_frees_it(client, digits):
    from blockflow.ml.inference import cache_state

    X = digits[0]
    model = _fresh_model(digits, 0.3)
    x = da.from_array(X, chunks=(450, 64))
    with ship_model(model, client=client) as ref:
        size = _payload_bytes(model)
        arrived = cache_state(client)
        assert {w["models"][ref.token]["state"] for w in arrived.values()} == {"bytes"}
        np.testing.assert_array_equal(blockflow.predict(ref, x).compute(), model.predict(X))
        state = cache_state(client)
        stats = model_stats(client, ref)
        for addr, w in state.items():
            m = w["models"][ref.token]
            # loaded: the model alone (its bytes dropped); not loaded: the bytes alone
            assert m["state"] in ("loaded", "bytes") and m["held_bytes"] == size
            assert m["serialised_bytes"] == (0 if m["state"] == "loaded" else size)
            assert (m["state"] == "loaded") == (stats[addr]["loads"] == 1)
            assert stats[addr]["state"] == m["state"]
        assert sum(w["models"][ref.token]["state"] == "loaded" for w in state.values()) >= 1
    assert all(ref.token not in w["models"] for w in cache_state(client).values())
    assert "blockflow-model-" + ref.token not in _scheduled(client)[0]
    assert ref.closed
    with pytest.raises(ValueError, match=r"^blockflow.predict: this ModelRef is closed \(its "
                                         r"model left the workers\); ship the model again"):
        blockflow.predict(ref, x)
    ref.close()  # idempotent


def test_two_references_to_one_model_free_it_when_the_last_closes(client, digits):
    from blockflow.ml.inference import cache_state

    model = _fresh_model(digits, 0.4)
    a, b = ship_model(model, client=client), ship_model(model, client=client)
    assert a.token == b.token
    a.close()
    assert all(b.token in w["models"] for w in cache_state(client).values())
    b.close()
    assert all(b.token not in w["models"] for w in cache_state(client).values())


def test_least_recently_used_models_are_evicted_past_the_bound(digits):
    import dask

    from blockflow.ml.inference import cache_state

    X = digits[0]
    models = [_fresh_model(digits, c) for c in (0.1, 0.2, 0.5)]
    size = _payload_bytes(models[0])
    x = da.from_array(X, chunks=(900, 64))
    with dask.config.set({"blockflow.inference.cache-bytes": int(2.5 * size)}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as c:
        refs = [ship_model(m, client=c) for m in models]
        [w] = cache_state(c).values()
        assert w["bound"] == int(2.5 * size)
        # three arrived, two fit: the least recently used (the first) was dropped
        assert [w["models"][r.token]["state"] for r in refs] == ["evicted", "bytes", "bytes"]
        for r, m in zip(refs, models):  # each used in turn, the first fetched again
            np.testing.assert_array_equal(blockflow.predict(r, x).compute(), m.predict(X))
            [w] = cache_state(c).values()
            assert w["held_bytes"] <= int(2.5 * size)
            assert w["models"][r.token]["state"] == "loaded"
            assert list(w["models"])[-1] == r.token  # the most recently used last
        assert [w["models"][r.token]["state"] for r in refs] == ["evicted", "loaded", "loaded"]
        [s0] = model_stats(c, refs[0]).values()
        assert s0["evictions"] == 2 and s0["loads"] == 1 and s0["bytes_received"] == 2 * size
        np.testing.assert_array_equal(blockflow.predict(refs[0], x).compute(),
                                      models[0].predict(X))
        for r in refs:
            r.close()
        [w] = cache_state(c).values()
        assert w == {"bound": int(2.5 * size), "models": {}, "held_bytes": 0}
