"""blockflow.predict on real clusters: models trained here on scikit-learn's bundled digits,
shipped once per worker, batches sized to free (simulated) device memory, results equal to
the model applied to the whole data."""

from __future__ import annotations

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

from blockflow.cluster.identity import workers_info


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
    from distributed.protocol.pickle import dumps

    return len(dumps(model))


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
