"""Pools declared in the ``blockflow.pools`` setting: checked with one line naming the pool and
the field, turned into :class:`blockflow.Pool` by one function, and given to the embedded
cluster of :func:`blockflow.connect`."""

from __future__ import annotations

import dask.config
import pytest

import blockflow
from blockflow import config
from blockflow.pools.cluster import pools_from_settings

POOLS = [
    {"name": "cheap", "provider": "onprem", "region": "lab", "price": 0.5, "workers": 2},
    {"name": "fast", "provider": "gcp", "price": 4.0, "egress": 0.12, "speed": 2,
     "workers": 1},
]


def test_the_setting_defaults_to_no_pools():
    assert dask.config.get("blockflow.pools") == []
    assert pools_from_settings() == {}


def test_pools_from_the_setting_keep_every_field_and_their_order():
    with dask.config.set({"blockflow.pools": POOLS}):
        config.validate()
        pools = pools_from_settings()
    assert [(p.name, n) for p, n in pools.items()] == [("cheap", 2), ("fast", 1)]
    cheap, fast = pools
    assert (cheap.provider, cheap.region, cheap.price, cheap.egress) == ("onprem", "lab", 0.5, 0)
    assert (fast.provider, fast.price, fast.egress, fast.speed) == ("gcp", 4.0, 0.12, 2.0)
    assert cheap.price_per_second == pytest.approx(0.5 / 3600)


@pytest.mark.parametrize("entry, message", [
    ({"name": "fast", "workers": 1, "price": -1},
     "'blockflow.pools[1].price' of pool 'fast': -1 is less than the minimum of 0"),
    ({"name": "fast", "workers": 0},
     "'blockflow.pools[1].workers' of pool 'fast': 0 is less than the minimum of 1"),
    ({"name": "fast", "workers": 1, "spede": 2},
     "'blockflow.pools[1].spede' of pool 'fast': 2 is set for an unknown key (did you mean "
     "'speed'?)"),
    ({"name": "fast", "workers": 1, "speed": {"train": 0}},
     "'blockflow.pools[1].speed.train' of pool 'fast': 0 is less than or equal to the "
     "minimum of 0"),
    ({"name": "fast", "workers": 1, "min-billed": "soon"},
     "'blockflow.pools[1].min-billed' of pool 'fast': 'soon' is not a duration of 0 or more"),
    ({"name": "fast"}, "'blockflow.pools[1]' of pool 'fast': 'workers' is a required property"),
])
def test_a_bad_pool_in_the_setting_is_one_line_naming_the_pool_and_the_field(entry, message):
    with dask.config.set({"blockflow.pools": [POOLS[0], entry]}):
        with pytest.raises(ValueError) as e:
            config.validate()
    assert str(e.value).startswith(f"Invalid blockflow setting {message}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("entries, message", [
    ([POOLS[0], POOLS[0]], "The blockflow.pools setting names pool 'cheap' twice (entry 1); "
                           "give each pool its own name."),
    ([{"workers": 1}], "The blockflow.pools setting, entry 0: the pool has no name"),
    ([{"name": "x", "workers": True}], "The blockflow.pools setting, pool 'x': workers must be "
                                       "an integer >= 1"),
    ([{"name": "x", "workers": 1, "price": "cheap"}], "The blockflow.pools setting, pool 'x': "
                                                      "price must be a number >= 0"),
    ([{"name": "x", "workers": 1, "colour": "red"}], "The blockflow.pools setting, pool 'x': "
                                                     "unknown field 'colour'"),
    ("fast", "The blockflow.pools setting must be a list of pools"),
])
def test_pools_from_settings_refuses_what_no_pool_can_be(entries, message):
    with pytest.raises(ValueError) as e:
        pools_from_settings(entries)
    assert str(e.value).startswith(message)


def test_min_billed_and_a_speed_per_group_reach_the_pool_or_are_refused_by_name():
    """Fields ``blockflow.Pool`` may not take yet: passed on, or one line naming them."""
    entry = {"name": "fast", "workers": 1, "price": 4.0, "min_billed": "1m"}
    try:
        (pool,) = pools_from_settings([entry])
    except ValueError as e:
        assert str(e) == ("The blockflow.pools setting, pool 'fast': min-billed is not "
                          "supported by this version of blockflow.Pool; leave it out.")
    else:
        assert pool.min_billed == 60.0
    entry = {"name": "fast", "workers": 1, "speed": {"train": 4, "etl": 1.5}}
    try:
        (pool,) = pools_from_settings([entry])
    except ValueError as e:
        assert str(e).startswith("The blockflow.pools setting, pool 'fast': a speed per task "
                                 "group ({'train': 4, 'etl': 1.5}) is not supported")
    else:
        assert pool.speed_of("train") == 4 and pool.speed_of("etl") == 1.5


def test_connect_refuses_a_worker_count_other_than_the_pools():
    with dask.config.set({"blockflow.pools": POOLS}):
        with pytest.raises(ValueError, match=r"n_workers=2 but the blockflow.pools setting "
                                             r"has 3 workers; leave n_workers out"):
            blockflow.connect(n_workers=2)
        with dask.config.set({"blockflow.cluster.n-workers": 4}):
            with pytest.raises(ValueError, match=r"the setting blockflow.cluster.n-workers is "
                                                 r"4 but the blockflow.pools setting has 3"):
                blockflow.connect()


@pytest.mark.slow
def test_connect_puts_the_embedded_workers_in_the_pools_of_the_setting():
    with dask.config.set({"blockflow.pools": POOLS}):
        client = blockflow.connect(processes=False, gpu=False, threads_per_worker=1,
                                   dashboard_address=":0")
    try:
        status = blockflow.plugin_status(client)
        assert {n: len(p["workers"]) for n, p in status["pools"].items()} == {
            "cheap": 2, "fast": 1}
        assert status["pools"]["fast"]["price"] == 4.0
    finally:
        client.shutdown()
        client.close()
