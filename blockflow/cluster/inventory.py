"""Resource discovery: the workers of a cluster with their CPUs, host memory and GPUs."""

from __future__ import annotations

import html
import warnings
from dataclasses import asdict, dataclass, field, fields, replace

import pandas as pd
from dask.utils import format_bytes
from distributed import Client

from blockflow._distributed import worker_plugins
from blockflow._distributed.metrics import read_metrics
from blockflow.cluster.hpc import batch_job
from blockflow.devices import device_info
from blockflow.errors import BlockflowWarning
from blockflow.pools.pool import pools_of
from blockflow.scheduling.view import workers_info
from blockflow.scheduling.wait import run_each

__all__ = ["Inventory", "WorkerResources", "inventory"]


@dataclass(frozen=True)
class WorkerResources:
    """One worker's resources (GPU fields None on CPU workers).

    Attributes
    ----------
    address, host, name : str
    threads : int
    memory_limit : int or None
        Host memory limit, bytes (None: unlimited).
    device : str
        ``"gpu"`` or ``"cpu"``.
    gpu_name, gpu_uuid : str or None
    gpu_memory_total, gpu_memory_used : int or None
        Bytes.
    gpu_utilization : float or None
        Percent 0-100 (None where NVML does not report it, e.g. MIG).
    simulated : bool
    resources : dict
        Declared worker resources.
    shares_gpu_with : tuple of str
        The other workers with the same ``gpu_uuid``.
    job_system, job_id, job_queue : str or None
        Its batch job (:func:`blockflow.cluster.hpc.batch_job`).
    pool, provider, region : str
        Its pool (:class:`blockflow.Pool`).
    price : float or None
        Dollars per worker-hour.
    """

    address: str
    host: str
    name: str
    threads: int
    memory_limit: int | None
    device: str
    gpu_name: str | None
    gpu_uuid: str | None
    gpu_memory_total: int | None
    gpu_memory_used: int | None
    gpu_utilization: float | None
    simulated: bool = False
    resources: dict = field(default_factory=dict)
    shares_gpu_with: tuple = ()
    job_system: str | None = None
    job_id: str | None = None
    job_queue: str | None = None
    pool: str = "default"
    provider: str = "local"
    region: str = ""
    price: float | None = None


def _probe_device(dask_worker=None) -> dict:
    """Run on a worker: its GPU's name and UUID (``describe_device()`` or NVML), or ``{}``."""
    for plugin in worker_plugins(dask_worker).values():
        describe_device = getattr(plugin, "describe_device", None)
        if not callable(describe_device):
            continue
        try:
            described = describe_device()
        except Exception:
            continue
        if described:
            return dict(described)
    info = device_info()
    if info is None:
        return {}
    return {"gpu_name": info.name, "gpu_uuid": info.uuid, "gpu_mig": info.mig}


def _probe_worker(gpu_workers=(), dask_worker=None) -> dict:
    """Run on every worker: its batch job and, on ``gpu_workers``, its device."""
    out = {"job": batch_job()}
    if dask_worker is not None and dask_worker.address in set(gpu_workers):
        out["device"] = _probe_device(dask_worker)
    return out


class Inventory:
    """Table of a cluster's workers: iterable over :class:`WorkerResources` (:func:`inventory`)."""

    def __init__(self, workers: list[WorkerResources]):
        self.workers = sorted(workers, key=lambda w: w.address)

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self):
        return iter(self.workers)

    @property
    def n_gpus(self) -> int:
        """Number of distinct GPUs: workers that share one device (same UUID) count once;
        a GPU worker whose device UUID is unknown counts as one."""
        return len({w.gpu_uuid or w.address for w in self.workers if w.device == "gpu"})

    @property
    def n_gpu_workers(self) -> int:
        """Number of workers with a GPU."""
        return sum(w.device == "gpu" for w in self.workers)

    @property
    def shared_gpus(self) -> dict[str, tuple[str, ...]]:
        """GPU UUID -> sorted addresses of the workers sharing it, for shared GPUs."""
        groups: dict[str, list[str]] = {}
        for w in self.workers:
            if w.device == "gpu" and w.gpu_uuid:
                groups.setdefault(w.gpu_uuid, []).append(w.address)
        return {u: tuple(sorted(a)) for u, a in sorted(groups.items()) if len(a) > 1}

    @property
    def undeclared_gpu_workers(self) -> list[str]:
        """GPU workers that declare no ``GPU`` resource."""
        return [w.address for w in self.workers
                if w.device == "gpu" and not w.resources.get("GPU")]

    @property
    def gpu_resource_without_gpu(self) -> list[str]:
        """Workers that declare a ``GPU`` resource but report no GPU."""
        return [w.address for w in self.workers
                if w.device != "gpu" and w.resources.get("GPU")]

    @property
    def total_threads(self) -> int:
        return sum(w.threads for w in self.workers)

    def to_pandas(self) -> pd.DataFrame:
        """One row per worker, columns as :class:`WorkerResources` (bytes, percent)."""
        cols = [f.name for f in fields(WorkerResources)]
        df = pd.DataFrame([asdict(w) for w in self.workers], columns=cols)
        for c in ("memory_limit", "gpu_memory_total", "gpu_memory_used"):
            df[c] = df[c].astype("Int64")
        df["gpu_utilization"] = df["gpu_utilization"].astype("Float64")
        df["price"] = df["price"].astype("Float64")
        return df

    def _display_rows(self) -> list[dict[str, str]]:
        def b(v):
            return "n/a" if v is None else format_bytes(v)

        rows = []
        for w in self.workers:
            gpu = "n/a"
            if w.device == "gpu":
                gpu = f"{w.gpu_name or 'GPU'}{' (simulated)' if w.simulated else ''}"
            rows.append({
                "worker": w.address, "host": w.host, "threads": str(w.threads),
                "memory limit": b(w.memory_limit), "device": w.device, "GPU": gpu,
                "device memory": "n/a" if w.gpu_memory_total is None
                else f"{b(w.gpu_memory_used)} / {b(w.gpu_memory_total)}",
                "GPU util": "n/a" if w.gpu_utilization is None else f"{w.gpu_utilization:.0f}%",
                "resources": ", ".join(f"{k}={v:g}" for k, v in sorted(w.resources.items()))
                or "none",
                "shares GPU with": ", ".join(w.shares_gpu_with) or "-",
                "pool": w.pool, "provider": w.provider + (f"/{w.region}" if w.region else ""),
                "$/h": "n/a" if w.price is None else f"{w.price:g}",
            })
        if any(w.job_id for w in self.workers):  # a column only on batch-job clusters
            for row, w in zip(rows, self.workers):
                row["batch job"] = (
                    f"{w.job_system} {w.job_id}" + (f" ({w.job_queue})" if w.job_queue else "")
                    if w.job_id else "-")
        return rows

    def __repr__(self) -> str:
        head = (f"<blockflow.Inventory: {len(self)} workers, {self.total_threads} threads, "
                f"{self.n_gpus} GPUs{self._shared_note()}>")
        if not self.workers:
            return head
        return head + "\n" + pd.DataFrame(self._display_rows()).to_string(index=False)

    def _shared_note(self) -> str:
        n = self.n_gpu_workers
        return f" for {n} GPU workers (some share a GPU)" if self.shared_gpus else ""

    def _repr_html_(self) -> str:
        rows = self._display_rows()
        head = (f"<p><b>blockflow inventory</b>: {len(self)} workers, {self.total_threads} "
                f"threads, {self.n_gpus} GPUs{html.escape(self._shared_note())}</p>")
        if not rows:
            return head
        th = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
        trs = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r.values()) + "</tr>"
            for r in rows
        )
        return f"{head}<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def inventory(client) -> Inventory:
    """Discover the workers of a cluster and their CPUs, host memory and GPUs.

    Device figures come from the latest heartbeat (distributed's NVML keys); workers reporting
    one device UUID share a GPU, counted once in :attr:`Inventory.n_gpus`.

    Parameters
    ----------
    client : distributed.Client

    Returns
    -------
    Inventory
        One :class:`WorkerResources` per worker, sorted by pool, then address.

    Warns
    -----
    BlockflowWarning
        When workers share a GPU.

    Raises
    ------
    TypeError
        If ``client`` is not a ``distributed.Client``.
    """
    if not isinstance(client, Client):
        raise TypeError(
            f"blockflow.inventory: expected a distributed.Client, got {type(client).__name__}; "
            f"get one with blockflow.connect()."
        )
    workers = workers_info(client)
    gpu_workers = [a for a, info in workers.items() if read_metrics(info.get("metrics")).has_gpu]
    # one call on every worker: its batch job, and on GPU workers its device
    probes = run_each(client, _probe_worker, gpu_workers, workers=list(workers),
                      what="the inventory's probe") if workers else {}
    probes = {a: p for a, p in probes.items() if isinstance(p, dict)}
    out = []
    pools = pools_of(workers)
    for addr, info in workers.items():
        m = read_metrics(info.get("metrics"))
        pool = pools[addr]
        probed = probes.get(addr) or {}
        probe = (probed.get("device") or {}) if m.has_gpu else {}
        job = probed.get("job") or {}
        limit = info.get("memory_limit") or None
        out.append(WorkerResources(
            address=addr,
            host=info.get("host", ""),
            name=str(info.get("name", addr)),
            threads=int(info.get("nthreads", 0)),
            memory_limit=int(limit) if limit else None,
            device="gpu" if m.has_gpu else "cpu",
            gpu_name=probe.get("gpu_name"),
            gpu_uuid=probe.get("gpu_uuid"),
            gpu_memory_total=int(m.gpu_memory_total) if m.has_gpu else None,
            gpu_memory_used=int(m.gpu_memory_used) if m.gpu_memory_used is not None else None,
            gpu_utilization=m.gpu_utilization,
            simulated=bool(probe.get("simulated", False)),
            resources=dict(info.get("resources") or {}),
            job_system=job.get("system"),
            job_id=job.get("job_id"),
            job_queue=job.get("queue"),
            pool=pool.name, provider=pool.provider, region=pool.region, price=pool.price,
        ))
    inv = Inventory(sorted(out, key=lambda w: (w.pool, w.address)))
    shared = inv.shared_gpus
    if shared:
        peers = {a: tuple(x for x in group if x != a) for group in shared.values() for a in group}
        inv = Inventory([replace(w, shares_gpu_with=peers.get(w.address, ())) for w in inv])
        listed = "; ".join(f"{', '.join(group)} all use GPU {u}" for u, group in shared.items())
        warnings.warn(
            f"blockflow.inventory: {listed}. Workers on one GPU share its memory and compute, "
            f"so the cluster has {inv.n_gpus} GPU{'s' if inv.n_gpus != 1 else ''} for "
            f"{inv.n_gpu_workers} GPU workers; start one worker per GPU (dask-cuda's "
            f"LocalCUDACluster or `dask cuda worker` set CUDA_VISIBLE_DEVICES for each) unless "
            f"the sharing is intended.", BlockflowWarning, stacklevel=2)
    return inv
