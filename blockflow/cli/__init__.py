"""blockflow's command line: run a ready workload on a Dask cluster, or show its inventory.

``blockflow run JOB`` starts an embedded cluster (:func:`blockflow.connect`) or connects to
``--address``, runs the workload and writes its results atomically to ``--output``;
``blockflow info`` prints a running cluster's workers. Also ``python -m blockflow`` and
``dask blockflow``. Exit statuses: 2 for a bad option or setting, 1 when the job cannot run
or fails (one line ``Error: ...``), 130 on Ctrl-C and 143 on SIGTERM, leaving no partial
output. Guide: docs/guide/clusters.md.
"""

from __future__ import annotations

import warnings
from typing import Any

import click
import dask.config
from dask.utils import format_bytes

from blockflow import config
from blockflow.cli.options import (
    _check_address,
    _cluster_options,
    _goal,
    _objective_options,
    _OptionError,
    _output_options,
    _progress,
    _progress_option,
    _retries_option,
    _timeout_option,
)
from blockflow.cli.session import (
    _client,
    _Group,
    _job,
    _page,
    _print_inventory,
    _warnings_as_lines,
    _without_dashboard_line,
    _written,
)

__all__ = ["cli", "main"]

_ARRAY_SIZES = ("small", "medium", "large")


@click.group(name="blockflow", cls=_Group,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="blockflow", prog_name="blockflow")
def cli() -> None:
    """blockflow: spread chunked data and AI workloads over many CPUs and GPUs with Dask.

    \b
    Jobs (blockflow run JOB --help for each):
      flights      the 2013 NYC flights ETL (Parquet tables)
      array-stats  per-grid-point moments of a gridded field
      train        data-parallel training of an MLP on the flights
      tune         asynchronous successive halving of an MLP on the digits
      infer        batch inference of a digits classifier
      pipeline     pipeline-parallel training of a small transformer
    """
    _validate_settings()


class _SettingsError(click.ClickException):
    """An invalid blockflow setting: ``Error: <message>`` and exit status 2."""

    exit_code = 2


def _validate_settings() -> None:
    """Check blockflow's settings once, before any command starts; warnings go to stderr."""
    # a policy other than the packaged one is checked against the policy registry: import
    # it then (it imports distributed, seconds on a loaded machine, which a command that
    # refuses its arguments should not wait for)
    if config.get("cluster.policy") != config.defaults["blockflow"]["cluster"]["policy"]:
        from blockflow.scheduling import policies  # noqa: F401

    with _warnings_as_lines():
        warnings.simplefilter("always")  # a setting's warning is a line whatever the filters
        try:
            config.validate()
        except ValueError as e:
            raise _SettingsError(str(e)) from None


@cli.group(name="run")
def run_group() -> None:
    """Run a ready job (flights, array-stats, train, tune, infer, pipeline) on a Dask cluster.

    Without --address an embedded cluster is started on this machine and shut down at the
    end. Results go to --output atomically: a failed run leaves no partial folder.
    """


@run_group.command(name="flights")
@click.option("--scale", type=int, default=1, show_default=True,
              help="Copies of the 336,776-row 2013 NYC flights table (>= 1).")
@_output_options("blockflow-flights-out",
                 "Folder for by_carrier.parquet, by_origin_month.parquet, manifest.json.")
@click.option("--partitions-per-copy", type=int, default=None,
              help="Partitions per copy of the table (>= 1). Default: 1 to 4, so that every "
                   "worker thread gets two (as flights.run chooses).")
@_progress_option
@_objective_options
@_retries_option
@_cluster_options
def flights_command(scale: int, output: str, overwrite: bool,
                    partitions_per_copy: int | None, no_progress: bool, retries: int,
                    **options: Any) -> None:
    """The 2013 NYC flights ETL: clean, feature, delay statistics per carrier and per
    (origin, month), written as Parquet."""
    from blockflow.workloads.flights_data import check_partitions_per_copy, check_scale

    try:  # bad input fails before the job's imports and before a cluster starts
        check_scale(scale)
        if partitions_per_copy is not None:
            check_partitions_per_copy(partitions_per_copy)
    except ValueError as e:
        raise _OptionError(str(e)) from None
    goal, cluster = _goal(options)
    from blockflow.workloads import flights
    with _job(output, overwrite, cluster, goal) as client:
        result = flights.run(client, scale=scale, output=output,
                             partitions_per_copy=partitions_per_copy, overwrite=overwrite,
                             progress=_progress(no_progress), retries=retries)
        _written()
        click.echo(_without_dashboard_line(result.report()))


@run_group.command(name="array-stats")
@click.option("--size", type=click.Choice(_ARRAY_SIZES), default="small", show_default=True,
              help="Field size: small (1 MB), medium (249 MB) or large (3.8 GB) of float32.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the field (>= 0).")
@_output_options("blockflow-array-stats-out", "Folder for stats.parquet and manifest.json.")
@_progress_option
@_retries_option
@_objective_options
@_cluster_options
def array_stats_command(size: str, seed: int, output: str, overwrite: bool, no_progress: bool,
                        retries: int, **options: Any) -> None:
    """Array statistics: per-grid-point moments of a generated gridded field (xarray),
    written as Parquet."""
    goal, cluster = _goal(options)
    from blockflow.workloads import array_stats

    with _job(output, overwrite, cluster, goal) as client:
        result = array_stats.run(client, size=size, output=output, overwrite=overwrite,
                                 seed=seed, progress=_progress(no_progress), retries=retries)
        _written()
        click.echo(f"blockflow array-stats: size {size} ({format_bytes(result.nbytes)}), "
                   f"seed {seed}")
        click.echo("")
        click.echo(result.summary().to_string())
        click.echo("")
        _echo_task_counts(result.task_counts)
        click.echo("")
        click.echo(f"Wall time: {result.wall_time:.2f} s")
        click.echo(f"Throughput: {format_bytes(result.bytes_per_second)}/s")
        click.echo(f"Output: {result.output}")


@run_group.command(name="train")
@click.option("--scale", type=click.IntRange(min=1), default=1, show_default=True,
              help="Copies of the 336,776-row 2013 NYC flights table (>= 1).")
@click.option("--epochs", type=click.IntRange(min=1), default=2, show_default=True,
              help="Passes over the training rows.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Samples per step, split over the workers by speed.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.01,
              show_default=True, help="Adam's learning rate (> 0).")
@click.option("--hidden", type=click.IntRange(min=1), default=32, show_default=True,
              help="Units of the MLP's hidden layer.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the initialisation and the batches (>= 0).")
@_output_options("blockflow-train-out",
                 "Folder for model.pt, metrics.json, loss_curve.csv, manifest.json.")
@_progress_option
@_objective_options
@_cluster_options
def train_command(scale: int, epochs: int, batch_size: int, lr: float, hidden: int,
                  seed: int, output: str, overwrite: bool, no_progress: bool,
                  **options: Any) -> None:
    """Train an MLP predicting, at departure, whether a 2013 NYC flight arrives > 15 minutes
    late (departure time and delay, carrier, origin, distance), data-parallel with
    speed-weighted shards; prints its held-out accuracy beside the majority class's."""
    goal, cluster = _goal(options)
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise click.ClickException(f"blockflow: run train needs PyTorch ({e}); install it "
                                   f"with pip install 'blockflow[ai]'.") from None
    from blockflow.workloads import train

    with _job(output, overwrite, cluster, goal) as client:
        result = train.run(client, output=output, scale=scale, epochs=epochs,
                           batch_size=batch_size, lr=lr, hidden=hidden, seed=seed,
                           overwrite=overwrite, progress=_progress(no_progress))
        _written()
        click.echo(result.report())
        click.echo("")
        _echo_task_counts(result.task_counts)


@run_group.command(name="tune")
@click.option("--configs", "n_configs", type=click.IntRange(min=1), default=81,
              show_default=True, help="MLP configurations drawn from the search space.")
@click.option("--eta", type=click.IntRange(min=2), default=3, show_default=True,
              help="Successive halving's factor: the top 1/eta of a rung is promoted.")
@click.option("--max-epochs", type=click.IntRange(min=1), default=27, show_default=True,
              help="Epochs of the top rung (rung 0 trains one).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the configurations (>= 0).")
@click.option("--promotion", type=click.Choice(["certain-first", "asha"]), default=None,
              help="Order of promotions: certain-first (synchronous SH's promotions first, "
                   "speculative ones for idle threads) or asha (Li et al.'s order). "
                   "Default: the setting blockflow.tune.promotion (certain-first).")
@_output_options("blockflow-tune-out",
                 "Folder for trials.parquet, history.parquet, best_model.pkl, manifest.json.")
@_progress_option
@_objective_options
@_cluster_options
def tune_command(n_configs: int, eta: int, max_epochs: int, seed: int,
                 promotion: str | None, output: str, overwrite: bool, no_progress: bool,
                 **options: Any) -> None:
    """Tune a small MLP on scikit-learn's bundled digits by asynchronous successive halving,
    trials running as Dask tasks on the fastest free workers."""
    goal, cluster = _goal(options)
    try:
        from blockflow.workloads import digits_tuning
        import sklearn  # noqa: F401  (the trials' model; digits_tuning imports it lazily)
    except ImportError as e:  # scikit-learn missing
        raise click.ClickException(f"blockflow: run tune needs scikit-learn ({e}); install "
                                   f"it with pip install 'blockflow[ai]'.") from None
    with _job(output, overwrite, cluster, goal) as client:
        result = digits_tuning.run(client, n_configs=n_configs, eta=eta, max_budget=max_epochs,
                                   seed=seed, promotion=promotion, output=output,
                                   overwrite=overwrite, progress=_progress(no_progress))
        _written()
        click.echo(result.report())
        click.echo("")
        _echo_task_counts(result.task_counts)


@run_group.command(name="infer")
@click.option("--scale", type=click.IntRange(min=1), default=10, show_default=True,
              help="Copies of scikit-learn's 1,797 digits to classify.")
@click.option("--blocks", type=click.IntRange(min=1), default=20, show_default=True,
              help="Row blocks of the replicated data.")
@_output_options("blockflow-infer-out", "Folder for predictions.parquet and manifest.json.")
@_progress_option
@_objective_options
@_cluster_options
def infer_command(scale: int, blocks: int, output: str, overwrite: bool, no_progress: bool,
                  **options: Any) -> None:
    """Batch inference: a digits classifier trained here, applied to a chunked copy of the
    digits with blockflow.predict (the model shipped once per worker)."""
    goal, cluster = _goal(options)
    try:
        from blockflow.workloads import digits_inference
        import sklearn  # noqa: F401
    except ImportError as e:  # scikit-learn missing
        raise click.ClickException(f"blockflow: run infer needs scikit-learn ({e}); install "
                                   f"it with pip install 'blockflow[ai]'.") from None
    with _job(output, overwrite, cluster, goal) as client:
        result = digits_inference.run(client, scale=scale, blocks=blocks, output=output,
                                      overwrite=overwrite, progress=_progress(no_progress))
        _written()
        click.echo(result.report())
        click.echo("")
        _echo_task_counts(result.task_counts)
        click.echo(f"Output: {result.output}")


@run_group.command(name="pipeline")
@click.option("--n-train", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Training sequences of the synthetic task (500 more are held out).")
@click.option("--epochs", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--micro-batches", "n_micro_batches", type=click.IntRange(min=1), default=4,
              show_default=True, help="Micro-batches per step (at most --batch-size).")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default="1f1b",
              show_default=True, help="Pipeline schedule.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@_output_options("blockflow-pipeline-out",
                 "Folder for model.pt, history.parquet, manifest.json.")
@_progress_option
@_objective_options
@_cluster_options
def pipeline_command(n_train: int, epochs: int, batch_size: int, n_micro_batches: int,
                     schedule: str, seed: int, output: str, overwrite: bool,
                     no_progress: bool, **options: Any) -> None:
    """Train a small transformer (a stack of nn.TransformerEncoderLayer) pipeline-parallel:
    stages on different workers, cut from measured layer times and free device memory."""
    goal, cluster = _goal(options)
    if n_micro_batches > batch_size:
        raise click.BadParameter(f"{n_micro_batches} micro-batches for batches of "
                                 f"{batch_size} rows; pass at most --batch-size.",
                                 param_hint="--micro-batches")
    try:
        import torch  # noqa: F401
        from blockflow.workloads import sequence
    except ImportError as e:  # PyTorch missing
        raise click.ClickException(f"blockflow: run pipeline needs PyTorch ({e}); install "
                                   f"it with pip install 'blockflow[ai]'.") from None
    with _job(output, overwrite, cluster, goal) as client:
        result = sequence.run(client, n_train=n_train, epochs=epochs, batch_size=batch_size,
                              n_micro_batches=n_micro_batches, schedule=schedule, seed=seed,
                              output=output, overwrite=overwrite,
                              progress=_progress(no_progress))
        _written()
        click.echo(result.report())
        click.echo("")
        _echo_task_counts(result.task_counts)
        click.echo(f"Output: {result.output}")


def _echo_task_counts(counts: dict[str, int] | None) -> None:
    if counts is None:
        click.echo("Tasks per worker: n/a (the scheduler runs no blockflow plugin)")
        return
    if not counts:
        click.echo("Tasks per worker (this run): none finished")
        return
    click.echo("Tasks per worker (this run):")
    width = max(len(w) for w in counts)
    for worker, n in sorted(counts.items()):
        click.echo(f"  {worker:<{width}}  {n:>6,}")


@cli.command(name="info")
@click.option("--address", metavar="ADDRESS", default=None,
              help="Scheduler of the cluster to show (tcp://host:8786). Default: Dask's "
                   "scheduler-address setting (DASK_SCHEDULER_ADDRESS).")
@_timeout_option
def info_command(address: str | None, timeout: float | None) -> None:
    """Print the workers of a running cluster with their threads, memory and GPUs."""
    address = address or dask.config.get("scheduler-address", None)
    if not address:  # an embedded cluster started here would be gone before it was seen
        raise _OptionError(
            "blockflow info shows a running cluster: point it at one with --address "
            "tcp://host:8786 (or DASK_SCHEDULER_ADDRESS=tcp://host:8786). `blockflow run` "
            "starts an embedded cluster only for the length of its job.")
    _check_address(address)
    with _client(address, timeout=timeout, announce=False) as client:
        _print_inventory(client)
        click.echo(f"Dashboard: {_page(client.dashboard_link)}")


def main() -> None:
    """Entry point of ``python -m blockflow``."""
    cli(prog_name="blockflow")
