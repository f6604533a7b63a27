"""torch.distributed process groups on Dask workers (blockflow.ml._group): real workers,
real gloo groups; a rank's error is its own, a lost worker ends the group at once."""

import os
import signal

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from distributed import Client, Event, LocalCluster  # noqa: E402

from blockflow.ml._group import GroupLost, run_group, worker_processes  # noqa: E402


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def _sum_ranks(ctx, x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return ctx.rank, ctx.world_size, ctx.backend, float(t), torch.get_num_threads(), \
        ctx.worker


def test_ranks_form_one_gloo_group_on_the_chosen_workers(client):
    workers = worker_processes(client)
    out = run_group(client, workers, _sum_ranks, [(r + 1,) for r in range(3)])
    assert [o[0] for o in out] == [0, 1, 2]
    assert {o[1:5] for o in out} == {(3, "gloo", 6.0, 1)}
    assert [o[5] for o in out] == workers
    # the group is torn down: the same workers form another, of two
    again = run_group(client, workers[1:], _sum_ranks, [(5,), (7,)])
    assert [o[3] for o in again] == [12.0, 12.0]


def _one_rank_fails(ctx):
    if ctx.rank == 1:
        raise ValueError("block 3 (rows 300-399) holds a NaN")
    t = torch.ones(1)
    dist.all_reduce(t)  # the peers wait here until rank 1's end closes the group
    return 1


def test_the_failing_rank_s_own_error_is_raised_not_its_peers(client):
    with pytest.raises(ValueError, match="block 3"):
        run_group(client, worker_processes(client), _one_rank_fails)


def test_one_process_holds_one_rank():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        assert len(worker_processes(c)) == 1
        with pytest.raises(ValueError, match="not in the cluster"):
            worker_processes(c, ["tcp://10.0.0.1:1"])


def _block(event_name):
    Event(event_name).wait()


def test_a_rank_whose_worker_is_busy_is_named_after_the_rendezvous_timeout(client):
    workers = worker_processes(client)
    busy = client.submit(_block, "bf-test-busy", workers=[workers[2]], pure=False)
    try:
        with pytest.raises(RuntimeError, match=f"{workers[2]} .rank 2. did not join"):
            run_group(client, workers, _sum_ranks, [(1,)] * 3, rendezvous_timeout=1)
    finally:
        Event("bf-test-busy").set()
        busy.result()


def _pid():
    return os.getpid()


def _wait_for_peers(ctx):
    t = torch.ones(1)
    if ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # this rank's worker dies mid-collective
    dist.all_reduce(t)
    return 1


def test_a_killed_rank_s_worker_ends_the_group_naming_it():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        workers = worker_processes(c)
        with pytest.raises(GroupLost, match=f"lost {workers[0]} .rank 0.") as info:
            run_group(c, workers, _wait_for_peers, name="test-rank",
                      collective_timeout=60)
        assert info.value.lost == {workers[0]}
        # the survivors left the broken group: they form a new one at once
        survivors = [w for w in worker_processes(c) if w != workers[0]][:2]
        assert [o[3] for o in run_group(c, survivors, _sum_ranks, [(1,), (2,)])] == [3.0] * 2


def test_two_ranks_in_one_process_are_refused_naming_both_workers():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        workers = sorted(c.scheduler_info()["workers"])
        with pytest.raises(RuntimeError, match="run in one process"):
            run_group(c, workers, _sum_ranks, [(1,), (2,)], rendezvous_timeout=5)


def _group_count_off_by(n):
    from torch.distributed.distributed_c10d import _world

    _world.group_count += n  # as a group that failed while forming leaves it


def test_a_worker_whose_earlier_group_failed_to_form_joins_the_next(client):
    workers = worker_processes(client)
    client.run(_group_count_off_by, 1, workers=[workers[1]])
    out = run_group(client, workers, _sum_ranks, [(1,), (2,), (3,)], rendezvous_timeout=10)
    assert [o[3] for o in out] == [6.0] * 3
