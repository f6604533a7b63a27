"""The boundary to distributed's internals: the one package that touches them.

Everything blockflow reads from or does to a running scheduler or worker beyond distributed's
public API goes through here: the scheduler plugin, the policies, the dashboard and the worker
plugins see only the plain data it returns (:class:`WorkerView`, :class:`TaskView`,
:class:`HeldResult`, ...) and act only through its functions (pause, resume, move, restrict,
hold, handlers, periodic callbacks, AMM policies, dashboard pages, worker metrics). A change
in distributed therefore breaks this package, loudly: :func:`check_scheduler` verifies every
scheduler-side internal listed below on the scheduler and its classes (and again on the
first live worker, :func:`check_worker_state`), :func:`check_worker` the worker's in every
worker plugin's ``setup``, and ``tests/test_boundary.py`` fails if any other module of
blockflow imports a private (``_name``) object of ``distributed`` or ``dask``, or touches an
attribute of distributed's state objects. Verified against distributed 2026.7.1.

Modules, by side (every public name is re-exported here: ``_distributed.<name>``)
-------------------------------------------------------------------------------
:mod:`~blockflow._distributed.checks`
    :data:`SUPPORTED`, :func:`check_scheduler`, :func:`check_worker`,
    :func:`check_worker_state`, :func:`check_dashboard`, :class:`IncompatibleSchedulerError`.
:mod:`~blockflow._distributed.views`
    The scheduler's workers as plain data: worker views, links, queued count, metadata.
:mod:`~blockflow._distributed.tasks`
    The scheduler's tasks as plain data: task views, held results, task states, running
    and unsatisfiable tasks, prefix durations.
:mod:`~blockflow._distributed.admission`
    Feeder tasks (producers feeding resource-bound consumers) and their states.
:mod:`~blockflow._distributed.actions`
    Actions on the scheduler: worker status, moves, restrictions, hold / release / fail,
    suspending the balancer, callbacks on its loop, backup requests.
:mod:`~blockflow._distributed.placement`
    What a task's spec declares (working set, placement, ``blockflow_work``) and the
    restrictions that place it; :data:`HOLD_ADDRESS`.
:mod:`~blockflow._distributed.extensions`
    What blockflow installs into the scheduler: plugins, handlers, periodic callbacks, the
    AMM policy adapter, HTTP routes, dashboard pages.
:mod:`~blockflow._distributed.worker`
    The worker side: metrics, comm handlers and calls, plugins, held data, resources, the
    current worker and task, task threads, the executor, the quiet-close filter.
:mod:`~blockflow._distributed.client`
    Client-side helpers: :func:`data_holders`, :class:`SchedulerProgress`,
    :func:`in_notebook_kernel`.
:mod:`~blockflow._distributed.deploy`
    A SpecCluster's private hooks: :func:`start_spec_workers` (new workers, failures raised),
    :func:`correct_state_soon`, :func:`replace_adaptive`.
:mod:`~blockflow._distributed.spans`
    distributed's spans for runs: the ``span`` annotation, a span's figures.
:mod:`~blockflow._distributed.graph`
    Dask's task-spec nodes (``dask._task_spec``): fusion aliases.
:mod:`~blockflow._distributed.nvml`
    distributed's private NVML helpers behind plain functions.
:mod:`~blockflow._distributed.wire`
    distributed's TCP framing (Dask's handshake, a message's length prefix and frames).
:mod:`~blockflow._distributed.metrics`
    The heartbeat metric names and their one parser (:func:`read_metrics`).

Internals used, and where
-------------------------
Scheduler (views, actions, extensions; checked by :func:`check_scheduler`)
    ``workers``, ``tasks``, ``queued``, ``plugins``, ``handlers``, ``extensions``
    (``"stealing"``, ``"amm"``, ``"spans"``), ``periodic_callbacks``, ``http_application``,
    ``handle_worker_status_change(status, worker, stimulus_id)``, ``bandwidth_workers``,
    ``valid_workers``, ``_get_prefix_duration``, ``register_worker_plugin``, ``unrunnable``,
    ``transition``, ``transitions``, ``coerce_address``, ``get_metadata``, ``bandwidth``,
    ``rpc``, ``loop``, ``add_plugin``.
WorkerState (views, actions)
    ``address``, ``name``, ``nthreads``, ``status``, ``metrics``, ``memory_limit``,
    ``processing``, ``executing``, ``occupancy``, ``has_what``, ``resources``, ``last_seen``.
TaskState (views, actions, placement)
    ``key``, ``state``, ``priority``, ``prefix`` (``TaskPrefix.duration_average``),
    ``run_spec``, ``actor``, ``nbytes``, ``dependencies``, ``who_has``, ``processing_on``,
    ``worker_restrictions``, ``host_restrictions``, ``resource_restrictions``,
    ``loose_restrictions``, ``dependents``, ``annotations``, ``retries`` (the task
    retries left, asked from a worker's task: :func:`task_retries_left`).
WorkStealing (views, actions)
    ``move_task_request(ts, victim, thief)``, ``in_flight``, ``in_flight_occupancy``.
ActiveMemoryManager (extensions)
    ``ActiveMemoryManagerPolicy.manager.scheduler``; ``Suggestion`` (``"replicate"`` /
    ``"drop"``); ``ActiveMemoryManagerExtension(register=False, start=False).run_once()``.
Worker (worker; checked by :func:`check_worker`)
    ``metrics``, ``data`` (its in-memory part), ``plugins``, ``handlers``, ``rpc``,
    ``executors``, ``heartbeat()``, ``set_resources()``, ``state.total_resources``,
    ``state.tasks[key].metadata`` and ``.annotations``, ``get_current_task()``,
    ``loop.asyncio_loop`` (:func:`call_worker_threadsafe`), ``scheduler_delay``;
    ``distributed.worker``'s ``thread_state`` and ``_worker_cvar``; ``scheduler.ncores(workers=)`` (the scheduler's
    RPC handler, from a worker or a client: :func:`listed_workers`).
Dashboard (extensions; checked by :func:`check_dashboard`)
    ``distributed.dashboard.scheduler.template_variables`` / ``applications``,
    ``distributed.dashboard.core.BokehApplication``,
    ``distributed.dashboard.components.add_periodic_callback``,
    ``distributed.dashboard.components.scheduler.BOKEH_THEME`` / ``env``.
Client (client)
    ``ProgressBar._draw_bar`` (overridden), ``distributed.utils.is_kernel``.
SpecCluster (deploy)
    ``SpecCluster._correct_state``, ``Cluster._adaptive``, ``distributed.utils.NoOpAwaitable``.
NVML (nvml)
    ``distributed.diagnostics.nvml._parse_cuda_visible_device``, ``_get_handle``,
    ``_get_memory_total``, ``_get_name``.
Dask (graph)
    ``dask._task_spec.Alias`` (``target``), ``GraphNode.substitute``.
Wire (wire)
    ``distributed.protocol.utils.pack_frames`` / ``unpack_frames`` and the uint64 length
    prefix of distributed's TCP comm.
"""

from __future__ import annotations

from blockflow._distributed.actions import (
    call_soon,
    fail_tasks,
    hold_tasks,
    move_task,
    release_tasks,
    request_backup,
    restrict_task,
    retire_idle_worker,
    set_worker_status,
    spawn,
    suspend_work_stealing,
)
from blockflow._distributed.admission import (
    FeederStates,
    FeederView,
    feeder_state_view,
    feeder_states,
    feeder_tasks,
)
from blockflow._distributed.checks import (
    IncompatibleSchedulerError,
    SUPPORTED,
    check_dashboard,
    check_scheduler,
    check_worker,
    check_worker_state,
    serves_bokeh_dashboard,
)
from blockflow._distributed.client import (
    SchedulerProgress,
    call_scheduler_handler,
    data_holders,
    has_scheduler_plugin,
    in_notebook_kernel,
    is_gc_diagnosis_callback,
)
from blockflow._distributed.deploy import correct_state_soon, replace_adaptive, start_spec_workers
from blockflow._distributed.extensions import (
    AMMPolicy,
    MemorySuggestion,
    add_amm_policy,
    add_dashboard_page,
    add_handler,
    add_http_routes,
    add_periodic_callback,
    add_scheduler_plugin,
    http_prefix,
    register_worker_plugin_on_scheduler,
    remove_periodic_callback,
    run_amm_policy,
    scheduler_plugin,
    style_dashboard_doc,
)
from blockflow._distributed.graph import (
    alias_target,
    renamed_task,
)
from blockflow._distributed.metrics import (
    CAPACITY_METRIC,
    DEVICE_UUID_METRIC,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_UTILIZATION,
    OWN_UTILIZATION_METRIC,
    POOL_METRIC,
    WorkerMetrics,
    clean_number,
    read_metrics,
)
from blockflow._distributed.nvml import (
    nvml_device_name,
    nvml_handle,
    nvml_memory_total,
    parse_visible_device,
)
from blockflow._distributed.placement import (
    HOLD_ADDRESS,
    WORK_ANNOTATION,
    finished_task_record,
    set_task_placement,
    task_facts,
    task_placement,
    task_size,
    task_work,
    task_working_set,
)
from blockflow._distributed.speculation import SpeculationHandlers, import_object
from blockflow._distributed.spans import span_annotation, span_figures
from blockflow._distributed.tasks import (
    HeldResult,
    RunningTask,
    TaskView,
    group_duration,
    held_results,
    input_holders,
    new_task_views,
    prefix_duration,
    running_tasks,
    task_states,
    unsatisfiable_tasks,
    waiting_tasks,
)
from blockflow._distributed.views import (
    WorkerView,
    WorkerViewCache,
    bandwidth,
    measured_bandwidth,
    own_utilization_estimate,
    queued_count,
    scheduler_metadata,
    shared_devices,
    worker_addresses,
    worker_names_and_metrics,
    worker_views,
    workers_holding_data,
)
from blockflow._distributed.wire import (
    HEADER_BYTES,
    client_handshake,
    decode_message,
    message_length,
    unpickle,
)
from blockflow._distributed.worker import (  # noqa: F401
    _ClosingHeartbeatFilter,
    HEARTBEAT_FAILED,
    HandlerPlugin,
    QuietClose,
    WAIT_METADATA,
    add_task_wait,
    call_worker,
    call_worker_soon,
    call_worker_threadsafe,
    current_task_key,
    current_worker,
    current_worker_resources,
    declare_worker_resources,
    has_worker_handler,
    listed_workers,
    quiet_closing_heartbeat,
    quiet_task_failures,
    registered_worker_plugin,
    remove_worker_metric,
    run_in_worker_executor,
    set_worker_metric,
    start_task_thread,
    task_retries_given,
    task_retries_left,
    task_wait,
    worker_data_values,
    worker_declared_resources,
    worker_heartbeat,
    worker_metric,
    worker_plugins,
    worker_scheduler_clock,
)

__all__ = [
    "AMMPolicy",
    "CAPACITY_METRIC",
    "DEVICE_UUID_METRIC",
    "FeederStates",
    "FeederView",
    "GPU_MEMORY_TOTAL",
    "GPU_MEMORY_USED",
    "GPU_UTILIZATION",
    "HEADER_BYTES",
    "HEARTBEAT_FAILED",
    "HOLD_ADDRESS",
    "HandlerPlugin",
    "HeldResult",
    "IncompatibleSchedulerError",
    "MemorySuggestion",
    "OWN_UTILIZATION_METRIC",
    "POOL_METRIC",
    "QuietClose",
    "RunningTask",
    "SUPPORTED",
    "SchedulerProgress",
    "SpeculationHandlers",
    "TaskView",
    "WAIT_METADATA",
    "WORK_ANNOTATION",
    "WorkerMetrics",
    "WorkerView",
    "WorkerViewCache",
    "add_amm_policy",
    "add_dashboard_page",
    "add_handler",
    "add_http_routes",
    "add_periodic_callback",
    "add_scheduler_plugin",
    "add_task_wait",
    "alias_target",
    "bandwidth",
    "call_scheduler_handler",
    "call_soon",
    "call_worker",
    "call_worker_soon",
    "call_worker_threadsafe",
    "check_dashboard",
    "check_scheduler",
    "check_worker",
    "check_worker_state",
    "clean_number",
    "client_handshake",
    "correct_state_soon",
    "current_task_key",
    "current_worker",
    "current_worker_resources",
    "data_holders",
    "declare_worker_resources",
    "decode_message",
    "fail_tasks",
    "feeder_state_view",
    "feeder_states",
    "feeder_tasks",
    "finished_task_record",
    "group_duration",
    "has_scheduler_plugin",
    "has_worker_handler",
    "held_results",
    "hold_tasks",
    "http_prefix",
    "import_object",
    "in_notebook_kernel",
    "input_holders",
    "is_gc_diagnosis_callback",
    "listed_workers",
    "measured_bandwidth",
    "message_length",
    "move_task",
    "new_task_views",
    "nvml_device_name",
    "nvml_handle",
    "nvml_memory_total",
    "own_utilization_estimate",
    "parse_visible_device",
    "prefix_duration",
    "queued_count",
    "quiet_closing_heartbeat",
    "quiet_task_failures",
    "read_metrics",
    "register_worker_plugin_on_scheduler",
    "registered_worker_plugin",
    "release_tasks",
    "remove_periodic_callback",
    "remove_worker_metric",
    "renamed_task",
    "replace_adaptive",
    "request_backup",
    "restrict_task",
    "retire_idle_worker",
    "run_amm_policy",
    "run_in_worker_executor",
    "running_tasks",
    "scheduler_metadata",
    "scheduler_plugin",
    "serves_bokeh_dashboard",
    "set_task_placement",
    "set_worker_metric",
    "set_worker_status",
    "shared_devices",
    "span_annotation",
    "span_figures",
    "spawn",
    "start_spec_workers",
    "start_task_thread",
    "style_dashboard_doc",
    "suspend_work_stealing",
    "task_facts",
    "task_placement",
    "task_retries_given",
    "task_retries_left",
    "task_size",
    "task_states",
    "task_wait",
    "task_work",
    "task_working_set",
    "unpickle",
    "unsatisfiable_tasks",
    "waiting_tasks",
    "worker_addresses",
    "worker_data_values",
    "worker_declared_resources",
    "worker_heartbeat",
    "worker_metric",
    "worker_names_and_metrics",
    "worker_plugins",
    "worker_scheduler_clock",
    "worker_views",
    "workers_holding_data",
]
