"""blockflow's settings: defaults in ``blockflow.yaml`` under ``dask.config``'s ``blockflow.`` namespace.

Importing blockflow loads the defaults (its one import side effect) and checks the settings
against ``blockflow-schema.yaml``, so that an invalid value (say from
``DASK_BLOCKFLOW__REBALANCER__HOT_HIGH=500``) fails at once with a ``ValueError`` naming the
key; :func:`blockflow.connect` checks them again. Users override them the usual Dask ways:
``dask.config.set({"blockflow.reduction.split-every": 8})``, a YAML file in
``~/.config/dask/``, or environment variables such as ``DASK_BLOCKFLOW__CLUSTER__GPU=false``.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

_here = os.path.dirname(__file__)
DEFAULTS_PATH = os.path.join(_here, "blockflow.yaml")
SCHEMA_PATH = os.path.join(_here, "blockflow-schema.yaml")

with open(DEFAULTS_PATH) as f:
    defaults: dict[str, Any] = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def get(key: str, value: Any = None) -> Any:
    """Return ``value`` unless it is None, else the setting ``blockflow.<key>``.

    Parameters
    ----------
    key : str
        Key below the ``blockflow.`` namespace, e.g. ``"reduction.split-every"``.
    value : object, optional
        An explicit argument; it wins over the configuration when not None.

    Returns
    -------
    object
        The explicit value or the configured one.
    """
    if value is not None:
        return value
    return dask.config.get(f"blockflow.{key}")


def validate(config: dict | None = None) -> None:
    """Check blockflow's settings against ``blockflow-schema.yaml``.

    Parameters
    ----------
    config : dict, optional
        A mapping with a top-level ``"blockflow"`` key; by default the current
        ``dask.config`` settings.

    Raises
    ------
    ValueError
        If a setting has the wrong type or value; the message names the key.
    """
    import jsonschema

    with open(SCHEMA_PATH) as f:
        schema = yaml.safe_load(f)
    if config is None:
        config = {"blockflow": dask.config.get("blockflow")}
    config = _kebab_keys(config)
    try:
        jsonschema.validate(config, schema)
    except jsonschema.ValidationError as e:
        path = [str(p) for p in e.absolute_path]
        where = ".".join(path) or "blockflow"
        env = "DASK_" + "__".join(p.upper().replace("-", "_") for p in path)
        source = (f" (from the environment variable {env}={os.environ[env]!r})"
                  if path and env in os.environ else "")
        raise ValueError(
            f"Invalid blockflow setting {where!r}{source}: {e.message}. "
            f"See {SCHEMA_PATH} for the allowed values."
        ) from None


def _kebab_keys(config: Any) -> Any:
    """Keys with ``_`` spelled ``-``, as ``dask.config.get`` reads them (environment
    variables arrive as ``hot_high``); where both spellings exist the ``-`` one wins, as in
    ``dask.config.get``."""
    if not isinstance(config, dict):
        return config
    out: dict[Any, Any] = {}
    for k, v in config.items():
        kebab = k.replace("_", "-") if isinstance(k, str) else k
        if kebab in out and kebab != k:
            continue  # the exact "-" key, seen first or later, wins
        out[kebab] = _kebab_keys(v)
    return out


# Fail at import, naming the key, rather than deep inside a computation.
validate()
