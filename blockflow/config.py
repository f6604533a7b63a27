"""blockflow's settings: defaults in ``blockflow.yaml`` under ``dask.config``'s ``blockflow.`` namespace.

Importing blockflow loads the defaults (its one import side effect). Users override them the
usual Dask ways: ``dask.config.set({"blockflow.reduction.split-every": 8})``, a YAML file in
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
    try:
        jsonschema.validate(config, schema)
    except jsonschema.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "blockflow"
        raise ValueError(
            f"Invalid blockflow setting {where!r}: {e.message}. "
            f"See {SCHEMA_PATH} for the allowed values."
        ) from None
