"""blockflow.aggregations on empty and all-missing data: grouped_moments and grouped_quantiles
equal pandas' groupby for empty partitions, all partitions empty, groups present in only some
partitions, all-missing groups, missing keys, single-row groups, integer and float columns and
several keys; the empty table's columns and dtypes; exact messages for bad input.

The flights-style cases (large synthetic frames on a LocalCluster) stay in tests/workloads/test_flights.py.
Everything here runs on Dask's synchronous scheduler so hypothesis stays fast.
"""

from __future__ import annotations

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockflow.aggregations import grouped_moments, grouped_quantiles, quantile_label
from blockflow.errors import BlockKernelError

# Few examples each: every one builds and computes a graph (~0.5 s on a loaded machine).
property_settings = settings(max_examples=12, deadline=None)
STATS = ("count", "mean", "std", "max")


@pytest.fixture(autouse=True)
def synchronous():
    with dask.config.set(scheduler="sync"):
        yield


def from_parts(parts: list[pd.DataFrame]) -> dd.DataFrame:
    """A dask dataframe with exactly these partitions (empty ones included)."""
    return dd.from_delayed([dask.delayed(p) for p in parts], meta=parts[0].iloc[:0],
                           verify_meta=False)


# --- pandas oracles ------------------------------------------------------------------------


def pandas_moments(df: pd.DataFrame, by: list[str], columns: list[str], dropna: bool = True
                   ) -> pd.DataFrame:
    groups = df.groupby(by, dropna=dropna)
    out = groups.size().rename("rows").to_frame()
    for c in columns:
        for stat in STATS:
            out[f"{c}_{stat}"] = groups[c].agg(stat)
    return out.reset_index()


def pandas_quantiles(df: pd.DataFrame, by: list[str], column: str, qs: list[float],
                     dropna: bool = True) -> pd.DataFrame:
    labels = [f"{column}_{quantile_label(q)}" for q in qs]
    if df.groupby(by, dropna=dropna).ngroups == 0:  # pandas' unstack loses the columns here
        return df[by].iloc[:0].assign(**{label: np.zeros(0) for label in labels})
    out = df.groupby(by, dropna=dropna)[column].quantile(qs).unstack()
    # unstack moves missing keys first; groupby's own order has them last
    out = out.reset_index().sort_values(by, na_position="last", ignore_index=True)
    out.columns = list(by) + labels
    return out.astype({label: "float64" for label in labels})


def assert_same_table(got: pd.DataFrame, expected: pd.DataFrame, *, atol: float = 1e-9) -> None:
    """Same columns and rows; keys, counts and integer columns exactly (and their dtypes);
    floats to rtol 1e-9 (``atol`` absolute, for the quantile estimate's bound)."""
    assert list(got.columns) == list(expected.columns)
    assert len(got) == len(expected), (got, expected)
    for col in expected.columns:
        a, e = got[col], expected[col]
        # pandas turns a key column of only missing strings into float NaN: compare those
        # as keys
        if pd.api.types.is_float_dtype(e.dtype) and pd.api.types.is_numeric_dtype(a.dtype):
            assert pd.api.types.is_float_dtype(a.dtype), col
            np.testing.assert_allclose(a.to_numpy(float, na_value=np.nan),
                                       e.to_numpy(float, na_value=np.nan), rtol=1e-9,
                                       atol=atol, equal_nan=True, err_msg=col)
        elif pd.api.types.is_integer_dtype(e.dtype):
            assert a.dtype == e.dtype, (col, a.dtype, e.dtype)
            np.testing.assert_array_equal(a.to_numpy(), e.to_numpy(), err_msg=col)
        else:  # string keys: Dask's string dtype vs pandas' object/str
            assert a.isna().tolist() == e.isna().tolist(), col
            assert a[a.notna()].astype(object).tolist() == e[e.notna()].astype(object).tolist()


# --- the two failing scenarios, exact --------------------------------------------


def test_partition_whose_only_group_value_is_nan():
    # Issue 10: IndexError. Partition 2 holds group "b" alone, and its only value is NaN.
    df = pd.DataFrame({"k": ["a", "a", "b"], "x": [1.0, 2.0, np.nan]})
    ddf = from_parts([df.iloc[:2], df.iloc[2:]])
    got = grouped_quantiles(ddf, "k", "x", [0.5, 0.9], split_every=2).compute()
    assert got["k"].tolist() == ["a", "b"]
    np.testing.assert_array_equal(got["x_p50"].to_numpy(), [1.5, np.nan])
    np.testing.assert_array_equal(got["x_p90"].to_numpy(), [1.9, np.nan])
    assert_same_table(got, pandas_quantiles(df, ["k"], "x", [0.5, 0.9]), atol=0)
    # the same group alone in a one-partition collection
    alone = grouped_quantiles(from_parts([df.iloc[2:]]), "k", "x", 0.5).compute()
    assert alone["k"].tolist() == ["b"] and np.isnan(alone["x_p50"].iloc[0])

    moments = grouped_moments(ddf, "k", "x", split_every=2).compute()
    assert moments["rows"].tolist() == [2, 1]
    assert moments["x_count"].tolist() == [2, 0]
    np.testing.assert_array_equal(moments["x_mean"].to_numpy(), [1.5, np.nan])
    np.testing.assert_allclose(moments["x_std"].to_numpy(), [np.sqrt(0.5), np.nan])
    np.testing.assert_array_equal(moments["x_max"].to_numpy(), [2.0, np.nan])
    assert_same_table(moments, pandas_moments(df, ["k"], ["x"]))


def test_every_partition_empty_after_a_filter_gives_the_empty_table():
    # Issue 10: IndexError in grouped_quantiles. The documented empty table instead.
    df = pd.DataFrame({"k": ["a", "b", "c", "d"], "j": [1, 2, 3, 4],
                       "x": np.array([1, 2, 3, 4], dtype="int8"), "y": [1.0, 2.0, 3.0, 4.0]})
    ddf = dd.from_pandas(df, npartitions=2)
    empty = ddf[ddf["y"] > 10]
    got = grouped_quantiles(empty, ["k", "j"], "y", [0.5, 0.9], split_every=2)
    table = got.compute()
    assert len(table) == 0
    assert list(table.columns) == ["k", "j", "y_p50", "y_p90"]
    assert [str(t) for t in table.dtypes] == [str(ddf["k"].dtype), "int64", "float64",
                                               "float64"]
    assert table.dtypes.equals(got._meta.dtypes)  # the lazy result announces the same

    got = grouped_moments(empty, ["k", "j"], ["x", "y"], split_every=2)
    table = got.compute()
    assert len(table) == 0
    assert list(table.columns) == ["k", "j", "rows", "x_count", "x_mean", "x_std", "x_max",
                                   "y_count", "y_mean", "y_std", "y_max"]
    assert [str(t) for t in table.dtypes] == [
        str(ddf["k"].dtype), "int64", "int64", "int64", "float64", "float64", "int8",
        "int64", "float64", "float64", "float64"]
    assert table.dtypes.equals(got._meta.dtypes)


# --- each case of the kind, exact ------------------------------------------------------------


def test_empty_partitions_and_groups_in_only_some_partitions():
    df = pd.DataFrame({"k": ["a", "a", "b", "a", "c", "c"],
                       "x": [1, 5, 7, 3, 10, 20]})
    parts = [df.iloc[:0], df.iloc[:2], df.iloc[2:2], df.iloc[2:4], df.iloc[4:], df.iloc[:0]]
    ddf = from_parts(parts)
    got = grouped_quantiles(ddf, "k", "x", [0.0, 0.5, 1.0], split_every=2).compute()
    assert got["k"].tolist() == ["a", "b", "c"]
    assert got["x_p0"].tolist() == [1.0, 7.0, 10.0]
    assert got["x_p50"].tolist() == [3.0, 7.0, 15.0]
    assert got["x_p100"].tolist() == [5.0, 7.0, 20.0]
    moments = grouped_moments(ddf, "k", "x", split_every=3).compute()
    assert moments["x_count"].tolist() == [3, 1, 2]
    assert moments["x_mean"].tolist() == [3.0, 7.0, 15.0]
    assert moments["x_max"].tolist() == [5, 7, 20] and moments["x_max"].dtype == np.int64
    np.testing.assert_allclose(moments["x_std"].to_numpy(), [2.0, np.nan, np.sqrt(50)])
    assert_same_table(moments, pandas_moments(df, ["k"], ["x"]))


def test_missing_keys_dropped_by_default_kept_with_dropna_false():
    df = pd.DataFrame({"k": ["a", None, "a", None, "b"], "m": [1.0, 1.0, np.nan, 2.0, 2.0],
                       "x": [1.0, 2.0, 3.0, 4.0, 5.0]})
    ddf = from_parts([df.iloc[:2], df.iloc[2:2], df.iloc[2:]])
    # pandas' default: a row with any missing key is dropped
    got = grouped_moments(ddf, ["k", "m"], "x", split_every=2).compute()
    assert got["k"].tolist() == ["a", "b"] and got["m"].tolist() == [1.0, 2.0]
    assert got["rows"].tolist() == [1, 1]
    assert_same_table(got, pandas_moments(df, ["k", "m"], ["x"]))
    q = grouped_quantiles(ddf, ["k", "m"], "x", 0.5, split_every=2).compute()
    assert q["x_p50"].tolist() == [1.0, 5.0]
    assert_same_table(q, pandas_quantiles(df, ["k", "m"], "x", [0.5]))
    # dropna=False: missing keys are groups of their own, sorted last
    got = grouped_moments(ddf, ["k", "m"], "x", dropna=False, split_every=2).compute()
    assert got["rows"].tolist() == [1, 1, 1, 1, 1]
    assert got["x_mean"].tolist() == [1.0, 3.0, 5.0, 2.0, 4.0]
    assert_same_table(got, pandas_moments(df, ["k", "m"], ["x"], dropna=False))
    q = grouped_quantiles(ddf, ["k", "m"], "x", 0.5, dropna=False, split_every=2).compute()
    assert q["x_p50"].tolist() == [1.0, 3.0, 5.0, 2.0, 4.0]
    assert_same_table(q, pandas_quantiles(df, ["k", "m"], "x", [0.5], dropna=False))


def test_every_key_missing_gives_the_empty_table():
    df = pd.DataFrame({"k": [np.nan, np.nan], "x": [1.0, 2.0]})
    ddf = from_parts([df.iloc[:1], df.iloc[1:]])
    q = grouped_quantiles(ddf, "k", "x", 0.5, split_every=2).compute()
    assert list(q.columns) == ["k", "x_p50"] and len(q) == 0
    assert [str(t) for t in q.dtypes] == ["float64", "float64"]
    m = grouped_moments(ddf, "k", "x", split_every=2).compute()
    assert len(m) == 0 and m["rows"].dtype == np.int64 and m["x_max"].dtype == np.float64


def test_single_row_groups_and_integer_columns_keep_pandas_dtypes():
    df = pd.DataFrame({"k": [1, 2, 2], "i": np.array([7, -3, 5], dtype="int16"),
                       "u": np.array([200, 3, 250], dtype="uint8"),
                       "f": np.array([0.5, 1.5, 2.5], dtype="float32")})
    ddf = from_parts([df.iloc[:1], df.iloc[1:2], df.iloc[:0], df.iloc[2:]])
    got = grouped_moments(ddf, "k", ["i", "u", "f"], split_every=2).compute()
    # single-row group 1: std NaN (ddof=1), as pandas
    assert np.isnan(got.loc[0, "i_std"]) and np.isnan(got.loc[0, "f_std"])
    assert got["i_std"].iloc[1] == pytest.approx(np.sqrt(32))
    assert got["i_max"].tolist() == [7, 5] and got["i_max"].dtype == np.int16
    assert got["u_max"].tolist() == [200, 250] and got["u_max"].dtype == np.uint8
    assert got["u_mean"].tolist() == [200.0, 126.5]
    assert got["f_max"].dtype == np.float32
    assert_same_table(got, pandas_moments(df, ["k"], ["i", "u", "f"]), atol=1e-6)
    q = grouped_quantiles(ddf, "k", "u", [0.5], split_every=2).compute()
    assert q["u_p50"].tolist() == [200.0, 126.5]


def test_nullable_columns_give_pandas_nullable_statistics():
    df = pd.DataFrame({"k": ["a", "a", "b", "c"],
                       "x": pd.array([1, 2, pd.NA, 4], dtype="Int64"),
                       "y": pd.array([1.5, None, None, 2.0], dtype="Float64")})
    ddf = from_parts([df.iloc[:1], df.iloc[1:3], df.iloc[:0], df.iloc[3:]])
    got = grouped_moments(ddf, "k", ["x", "y"], split_every=2).compute()
    assert got["x_count"].tolist() == [2, 0, 1] and str(got["x_count"].dtype) == "Int64"
    assert got["x_max"].isna().tolist() == [False, True, False]
    assert str(got["x_max"].dtype) == "Int64" and str(got["y_mean"].dtype) == "Float64"
    assert_same_table(got, pandas_moments(df, ["k"], ["x", "y"]))
    q = grouped_quantiles(ddf, "k", "x", [0.5, 0.9], split_every=2).compute()
    np.testing.assert_array_equal(q["x_p50"].to_numpy(), [1.5, np.nan, 4.0])
    np.testing.assert_allclose(q["x_p90"].to_numpy(), [1.9, np.nan, 4.0])


def test_bad_dropna_and_infinite_values_have_clear_messages():
    df = pd.DataFrame({"k": ["a", "b"], "x": [1.0, np.inf]})
    ddf = dd.from_pandas(df, npartitions=1)
    with pytest.raises(TypeError, match=r"^blockflow.aggregations.grouped_moments: dropna must "
                       r"be True \(drop rows with a missing key, as pandas' groupby\) or False "
                       r"\(keep them as their own group\), got 'yes'.$"):
        grouped_moments(ddf, "k", "x", dropna="yes")
    with pytest.raises(TypeError, match="grouped_quantiles: dropna must be True"):
        grouped_quantiles(ddf, "k", "x", dropna=None)
    with pytest.raises(BlockKernelError) as info:
        grouped_quantiles(ddf, "k", "x", split_every=2).compute()
    assert str(info.value.__cause__) == (
        "blockflow.aggregations.grouped_quantiles: column 'x' has infinite values or values "
        "beyond 4.61e+18 x bin_width, which a histogram cannot bin; drop or clip them first "
        "(or use a larger bin_width).")


# --- property tests: any partitioning, empty partitions, all-missing groups ----------------


@st.composite
def frames(draw):
    """(pandas frame, its partitions): string and float keys with missing ones, an integer
    and a float value column (whole quarters, with NaN), sometimes a group whose values are
    all missing, cut into partitions of which some are empty."""
    n = draw(st.integers(0, 30))
    rows = st.lists(st.tuples(
        st.sampled_from(["a", "b", "c", None]),
        st.sampled_from([0.0, 1.0, np.nan]),
        st.integers(-5, 5),
        st.one_of(st.just(np.nan), st.integers(-8, 8).map(lambda v: v / 4)),
        st.booleans(),
    ), min_size=n, max_size=n)
    df = pd.DataFrame(draw(rows), columns=["k", "m", "i", "f", "keep"])
    df = df.astype({"k": object, "m": "float64", "i": "int64", "f": "float64", "keep": bool})
    if draw(st.booleans()):  # a group whose values are all missing, in one or more rows
        extra = pd.DataFrame({"k": "z", "m": 1.0, "i": 0, "f": np.nan, "keep": True},
                             index=range(draw(st.integers(1, 3))))
        df = pd.concat([df, extra], ignore_index=True)
    cuts = sorted(draw(st.lists(st.integers(0, len(df)), max_size=5)))
    bounds = [0] + cuts + [len(df)]
    parts = [df.iloc[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    return df, parts


by_choices = st.sampled_from([["k"], ["m"], ["k", "m"]])


@property_settings
@given(data=frames(), by=by_choices, dropna=st.booleans(), split_every=st.integers(2, 4),
       filtered=st.booleans())
@pytest.mark.slow
def test_grouped_moments_equal_pandas(data, by, dropna, split_every, filtered):
    df, parts = data
    ddf = from_parts(parts)
    if filtered:  # a filter empties partitions and removes groups from some of them
        ddf, df = ddf[ddf["keep"]], df[df["keep"]]
    got = grouped_moments(ddf, by, ["i", "f"], dropna=dropna, split_every=split_every)
    table = got.compute()
    assert_same_table(table, pandas_moments(df, by, ["i", "f"], dropna=dropna))
    assert table.dtypes.equals(got._meta.dtypes)


@property_settings
@given(data=frames(), by=by_choices, dropna=st.booleans(), split_every=st.integers(2, 4),
       filtered=st.booleans(), column=st.sampled_from(["i", "f"]))
@pytest.mark.slow
def test_grouped_quantiles_equal_pandas_exactly_on_the_grid(data, by, dropna, split_every,
                                                            filtered, column):
    # Whole numbers with bin_width=1 and quarters with bin_width=0.25 lie on the grid, where
    # the documented method is exact: equal to pandas' groupby().quantile().
    df, parts = data
    ddf = from_parts(parts)
    if filtered:
        ddf, df = ddf[ddf["keep"]], df[df["keep"]]
    qs = [0.0, 0.25, 0.5, 0.9, 1.0]
    bin_width = 1.0 if column == "i" else 0.25
    got = grouped_quantiles(ddf, by, column, qs, bin_width=bin_width, dropna=dropna,
                            split_every=split_every)
    table = got.compute()
    assert_same_table(table, pandas_quantiles(df, by, column, qs, dropna=dropna), atol=1e-12)
    assert table.dtypes.equals(got._meta.dtypes)


@property_settings
@given(values=st.lists(st.one_of(st.just(np.nan),
                                 st.floats(-100, 100, allow_nan=False, allow_subnormal=False)),
                       max_size=30),
       keys=st.lists(st.sampled_from(["a", "b"]), min_size=30, max_size=30),
       cuts=st.lists(st.integers(0, 30), max_size=4), bin_width=st.sampled_from([0.5, 3.0]))
@pytest.mark.slow
def test_grouped_quantiles_off_the_grid_within_half_a_bin(values, keys, cuts, bin_width):
    # The documented accuracy off the grid: within bin_width / 2 of pandas' quantile.
    df = pd.DataFrame({"k": keys[:len(values)], "x": np.array(values, dtype="float64")})
    bounds = [0] + sorted(min(c, len(df)) for c in cuts) + [len(df)]
    ddf = from_parts([df.iloc[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])])
    qs = [0.1, 0.5, 0.99]
    got = grouped_quantiles(ddf, "k", "x", qs, bin_width=bin_width, split_every=2).compute()
    assert_same_table(got, pandas_quantiles(df, ["k"], "x", qs), atol=bin_width / 2 + 1e-9)
