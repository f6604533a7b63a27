"""The simulated GPU: a device with a speed, measured utilisation and accounted memory."""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dask.sizeof import sizeof
from dask.utils import parse_bytes, parse_timedelta

from blockflow import _distributed
from blockflow.scheduling.speculation import cancelled

__all__ = ["OutOfMemoryError", "SimulatedDevice", "SimulatedDeviceBlock",
           "SimulatedOutOfMemoryError", "Tenant"]


_UUID_NAMESPACE = uuid.UUID("5f0c6f7e-2b1d-4c4e-9a57-b10cf10e51a5")


@dataclass(frozen=True, eq=False)
class SimulatedDeviceBlock:
    """A result in simulated device memory: a small real ``payload`` and a simulated ``nbytes``
    (int or ``"256MiB"``; default the payload's)."""

    payload: Any
    nbytes: int = None  # type: ignore[assignment]

    def __post_init__(self):
        nbytes = sizeof(self.payload) if self.nbytes is None else _parse_bytes(self.nbytes)
        if nbytes < 0:
            raise ValueError(f"SimulatedDeviceBlock: nbytes must be >= 0, got {nbytes}.")
        object.__setattr__(self, "nbytes", int(nbytes))

    def __repr__(self) -> str:
        return (f"<SimulatedDeviceBlock {self.nbytes:,} bytes, "
                f"payload {type(self.payload).__name__}>")


@sizeof.register(SimulatedDeviceBlock)
def _sizeof_device_block(block: SimulatedDeviceBlock) -> int:
    return block.nbytes


class OutOfMemoryError(MemoryError):
    """Named like CuPy's ``OutOfMemoryError``, which ``blockflow.errors.is_device_oom``
    recognises by class name."""


class SimulatedOutOfMemoryError(OutOfMemoryError):
    """A simulated kernel's working set does not fit in free simulated device memory (worded as
    CuPy's)."""

    def __init__(self, size: int, allocated: int, where: str = ""):
        self.size, self.allocated, self.where = int(size), int(allocated), where
        super().__init__(f"Out of memory allocating {self.size:,} bytes (allocated so far: "
                         f"{self.allocated:,} bytes).{' ' + where if where else ''}")

    def __reduce__(self):  # keep attributes across pickling (worker -> client)
        return type(self), (self.size, self.allocated, self.where)


def _parse_bytes(value: int | float | str) -> int:
    return int(parse_bytes(value) if isinstance(value, str) else value)


@dataclass
class Tenant:
    """Another process sharing a simulated device: it takes utilisation and device memory.

    Parameters
    ----------
    utilization : float, default 0
        Percent 0-100.
    memory : int or str, default 0
        Bytes.
    schedule : list of (seconds, percent, bytes), optional
        Sorted changes from ``seconds`` after the clock started (:func:`restart_clock`).

    Raises
    ------
    ValueError
        A percentage outside 0-100, a negative size or an unsorted schedule.
    """

    utilization: float = 0.0
    memory: int | str = 0
    schedule: Sequence[tuple[float, float, int | str]] | None = None

    def __post_init__(self):
        self.utilization, self.memory = _check_tenant_step(self.utilization, self.memory)
        steps = [(float(t), *_check_tenant_step(u, m)) for t, u, m in (self.schedule or ())]
        if any(b[0] < a[0] for a, b in zip(steps, steps[1:])):
            raise ValueError(f"Tenant schedule must be sorted by time, got {steps}.")
        self.schedule = steps

    def at(self, seconds: float) -> tuple[float, int]:
        """``(utilisation percent, memory bytes)`` at ``seconds`` since the clock started."""
        util, mem = self.utilization, self.memory
        for t, u, m in self.schedule:
            if t > seconds:
                break
            util, mem = u, m
        return util, mem

    @classmethod
    def coerce(cls, value: Any) -> Tenant | None:
        """A :class:`Tenant` from None, a Tenant, a dict of its fields, ``(percent, bytes)``
        or a schedule (list of ``(seconds, percent, bytes)``)."""
        if value is None or isinstance(value, Tenant):
            return value
        if isinstance(value, Mapping):
            return cls(**value)
        value = list(value)
        if len(value) == 2 and not isinstance(value[0], (tuple, list)):
            return cls(utilization=value[0], memory=value[1])
        return cls(schedule=value)


def _check_tenant_step(util, mem) -> tuple[float, int]:
    util, mem = float(util), _parse_bytes(mem)
    if not 0 <= util <= 100:
        raise ValueError(f"Tenant utilization must be a percentage 0-100, got {util:g}.")
    if mem < 0:
        raise ValueError(f"Tenant memory must be >= 0 bytes, got {mem}.")
    return util, mem


def _check_speed(speed) -> float:
    speed = float(speed)
    if not 0 < speed < float("inf"):
        raise ValueError(f"Simulated device speed must be a finite number > 0, got {speed!r}.")
    return speed


class SimulatedDevice:
    """One simulated GPU: speed, memory capacity, background tenant and run-time state.

    Parameters
    ----------
    speed : float, default 1.0
        Relative throughput: ``work`` seconds take ``work / speed``.
    device_memory : int or str, default "16GiB"
    tenant : Tenant, tuple, dict or list, optional
        See :meth:`Tenant.coerce`.
    speed_schedule : list of (seconds, speed), optional
        Sorted speed changes from the clock's start.
    tenant_contention : bool, default True
        A tenant busy ``u`` % leaves kernels ``max(1 - u/100, 0.5)`` of the device (blockflow
        heuristic); False: metrics only.
    window : float or str, default 1.0
        Seconds over which utilisation is measured.
    uuid : str, optional
        ``blockflow-gpu-uuid``; equal on two workers simulates a shared GPU.
    group_speeds : mapping of str to float, optional
        Task group (key prefix) -> its speed here, for groups that gain differently from this
        device (:meth:`work_of`); others run at ``speed``.
    bandwidth : int, float or str, default "1TB"
        Device memory bandwidth reported (``blockflow-device-bandwidth``), bytes per second.

    Notes
    -----
    Concurrent kernels share throughput equally (processor sharing, blockflow heuristic).
    """

    def __init__(self, speed: float = 1.0, device_memory: int | str = "16GiB", tenant=None,
                 speed_schedule: Sequence[tuple[float, float]] | None = None,
                 tenant_contention: bool = True, window: float | str = 1.0,
                 uuid: str | None = None, group_speeds: Mapping[str, float] | None = None,
                 bandwidth: int | float | str = "1TB"):
        self.base_speed = _check_speed(speed)
        self.group_speeds = {str(g): _check_speed(v) for g, v in (group_speeds or {}).items()}
        self.uuid = uuid
        self.bandwidth = _parse_bytes(bandwidth)
        if self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes per second, got {bandwidth!r}.")
        self.capacity = _parse_bytes(device_memory)
        if self.capacity <= 0:
            raise ValueError(f"device_memory must be > 0 bytes, got {self.capacity}.")
        self.tenant = Tenant.coerce(tenant)
        steps = [(float(t), _check_speed(s)) for t, s in (speed_schedule or ())]
        if any(b[0] < a[0] for a, b in zip(steps, steps[1:])):
            raise ValueError(f"speed_schedule must be sorted by time, got {steps}.")
        self.speed_schedule = steps
        self.tenant_contention = bool(tenant_contention)
        self.window = float(parse_timedelta(window))
        self.epoch = time.time()
        self.worker = None
        self._init_state()

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._speed_override: float | None = None
        self._active: dict[int, int] = {}  # token -> working-set bytes
        self._next_token = 0
        self._busy_since: float | None = None  # monotonic; set while any kernel runs
        self._busy: deque[tuple[float, float]] = deque()  # disjoint busy intervals
        self.busy_seconds = 0.0
        self.kernels = 0
        self.oom_errors = 0

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "worker")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.worker = None

    def __repr__(self) -> str:
        where = f" on {self.worker.address}" if self.worker is not None else ""
        return (f"<SimulatedDevice speed {self.speed():g}, {self.capacity:,} bytes"
                f"{', tenant' if self.tenant else ''}{where}>")

    # --- state at a time --------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since the clock of the schedules started."""
        return time.time() - self.epoch

    def speed(self) -> float:
        """Current speed factor (set at run time, else from the schedule, else the base)."""
        if self._speed_override is not None:
            return self._speed_override
        speed, now = self.base_speed, self.elapsed()
        for t, s in self.speed_schedule:
            if t > now:
                break
            speed = s
        return speed

    def tenant_now(self) -> tuple[float, int]:
        """``(utilisation percent, memory bytes)`` the tenant takes now."""
        return (0.0, 0) if self.tenant is None else self.tenant.at(self.elapsed())

    def effective_speed(self) -> float:
        """Speed a single kernel gets now: :meth:`speed` times the share the tenant leaves."""
        share = 1.0
        if self.tenant_contention:
            share = max(1.0 - self.tenant_now()[0] / 100.0, 0.5)
        return self.speed() * share

    # --- run-time changes (call through client.run) ------------------------------------

    def set_speed(self, speed: float | None) -> None:
        """Fix the speed from now on; None returns to the base speed and schedule."""
        self._speed_override = None if speed is None else _check_speed(speed)

    def set_tenant(self, tenant) -> None:
        """Replace the background tenant (None removes it); see :meth:`Tenant.coerce`."""
        self.tenant = Tenant.coerce(tenant)

    def restart_clock(self, epoch: float | None = None) -> None:
        """Restart the schedules' clock at ``epoch`` (seconds since the Unix epoch, default
        now); pass one shared value to all workers to start their schedules together."""
        self.epoch = time.time() if epoch is None else float(epoch)

    # --- metrics -----------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Device bytes of :class:`SimulatedDeviceBlock` results in the worker's memory."""
        if self.worker is None:
            return 0
        # Called from kernel threads beside the worker's event loop: worker_data_values reads
        # only in-memory values (a SpillBuffer's fast part), through the zict.LRU's dict without
        # touching the LRU order, in one C-level pass (retried if a mapping changed size).
        values = _distributed.worker_data_values(self.worker)
        return sum(v.nbytes for v in values if type(v) is SimulatedDeviceBlock)

    def memory_used(self) -> int:
        """Bytes in use, as NVML would report them: held blocks, working sets of running
        kernels and the tenant's bytes, at most the capacity."""
        with self._lock:
            in_flight = sum(self._active.values())
        return min(self.held_bytes() + in_flight + self.tenant_now()[1], self.capacity)

    def utilization(self) -> float:
        """Percent 0-100: measured busy fraction over the last ``window`` seconds plus the
        tenant's share, capped at 100."""
        return round(min(self.own_utilization() + self.tenant_now()[0], 100.0), 1)

    def own_utilization(self) -> float:
        """Percent 0-100 of the last ``window`` seconds the device spent on this worker's
        kernels (NVML's per-process utilisation on a real GPU)."""
        now = time.monotonic()
        start = now - self.window
        with self._lock:
            while self._busy and self._busy[0][1] <= start:
                self._busy.popleft()
            busy = sum(min(e, now) - max(s, start) for s, e in self._busy if e > start)
            if self._busy_since is not None:
                busy += now - max(self._busy_since, start)
        return min(100.0 * busy / self.window if self.window > 0 else 0.0, 100.0)

    def describe(self) -> dict[str, Any]:
        """Identity for ``blockflow.inventory``: name, a stable ``SIM-`` UUID, ``simulated``."""
        return {
            "gpu_name": f"Simulated GPU (speed {self.base_speed:g})",
            "gpu_uuid": self.device_uuid(),
            "simulated": True,
        }

    def device_uuid(self) -> str:
        """The UUID given, else a stable ``SIM-`` UUID of the worker's host and name."""
        if getattr(self, "uuid", None):
            return self.uuid
        if self.worker is None:
            ident = "unattached"
        else:
            try:
                host = self.worker.host
            except ValueError:  # in-process workers (inproc:// addresses) have no host
                host = self.worker.address
            ident = f"{host}/{self.worker.name}"
        return f"SIM-{uuid.uuid5(_UUID_NAMESPACE, ident)}"

    def stats(self) -> dict[str, Any]:
        """Counters and current metrics (plain data) for benchmark reports."""
        return {
            "speed": self.speed(), "effective_speed": self.effective_speed(),
            "utilization": self.utilization(), "memory_used": self.memory_used(),
            "memory_total": self.capacity, "held_bytes": self.held_bytes(),
            "tenant_utilization": self.tenant_now()[0], "tenant_memory": self.tenant_now()[1],
            "kernels": self.kernels, "busy_seconds": self._busy_total(),
            "oom_errors": self.oom_errors,
        }

    def _busy_total(self) -> float:
        with self._lock:
            extra = 0.0 if self._busy_since is None else time.monotonic() - self._busy_since
            return self.busy_seconds + extra

    # --- kernels -----------------------------------------------------------------------

    def _begin(self, working_set: int) -> int:
        """Reserve ``working_set`` bytes and mark the device busy; raise if they don't fit."""
        held = self.held_bytes()
        tenant_mem = self.tenant_now()[1]
        with self._lock:
            in_flight = sum(self._active.values())
            if working_set > self.capacity - held - tenant_mem - in_flight:
                self.oom_errors += 1
                w = self.worker
                where = "" if w is None else (
                    f"Simulated device of worker {w.name!r} ({w.address}): capacity "
                    f"{self.capacity:,} bytes, background tenant {tenant_mem:,} bytes."
                )
                raise SimulatedOutOfMemoryError(working_set, held + in_flight, where)
            token = self._next_token
            self._next_token += 1
            self._active[token] = working_set
            if self._busy_since is None:
                self._busy_since = time.monotonic()
            return token

    def _end(self, token: int) -> None:
        with self._lock:
            del self._active[token]
            self.kernels += 1
            if not self._active and self._busy_since is not None:
                now = time.monotonic()
                self._busy.append((self._busy_since, now))
                self.busy_seconds += now - self._busy_since
                self._busy_since = None
                while self._busy and self._busy[0][1] <= now - self.window:
                    self._busy.popleft()

    def work_of(self, work: float, group: str | None) -> float:
        """Reference-seconds ``work`` of a ``group`` task as this device's base speed runs it:
        scaled by the group's own speed (``group_speeds``), when it has one."""
        speed = self.group_speeds.get(group) if group is not None else None
        return work if speed is None else work * self.base_speed / speed

    def _run(self, work: float) -> None:
        """Sleep until ``work`` reference-seconds are done, re-reading speed, tenant and the
        number of concurrent kernels at least every 50 ms; stop early when this copy of a
        speculated task lost (:func:`blockflow.scheduling.speculation.cancelled`)."""
        remaining = work
        while remaining > 1e-9:
            if cancelled():  # the other copy of this task won: stop, as a real device would
                return
            rate = self.effective_speed() / max(len(self._active), 1)
            step = min(remaining / rate, 0.05)
            time.sleep(step)
            remaining -= step * rate
