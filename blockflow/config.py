"""blockflow's settings: the defaults in ``blockflow.yaml``, under ``dask.config``'s
``blockflow.`` namespace, checked against ``blockflow-schema.yaml``.

Importing blockflow loads the defaults (:func:`dask.config.update_defaults`); :func:`validate`
checks them where they are used, naming the key, its value and where it was set. The schema
adds ``x-duration``, ``x-bytes`` and ``x-ordered`` rules; :func:`set_choices` registers
allowed values from code. Reference: docs/configuration.rst.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import math
import os
import re
import sys
import types
import warnings
from typing import Any, Iterator, Mapping, Sequence

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from blockflow.errors import BlockflowWarning

_here = os.path.dirname(__file__)
DEFAULTS_PATH = os.path.join(_here, "blockflow.yaml")
SCHEMA_PATH = os.path.join(_here, "blockflow-schema.yaml")

with open(DEFAULTS_PATH) as f:
    defaults: dict[str, Any] = yaml.safe_load(f)

# What users set (environment, Dask config files, dask.config.set) before the defaults fill
# the gaps: update_defaults replaces a section set to a non-mapping (DASK_BLOCKFLOW__REBALANCER=5)
# by the default section, so it is only visible here. Kept as data; validate() reads it.
_user_settings = copy.deepcopy(dask.config.config.get("blockflow"))

dask.config.update_defaults(defaults)

_MISSING = object()

# Allowed values of keys whose choices are registered in code (set_choices), by dotted key.
_choices: dict[str, tuple[str, ...]] = {}
# A pattern other values may match instead (a dotted path), by dotted key.
_patterns: dict[str, str] = {}


def set_choices(key: str, values: Sequence[str], pattern: str | None = None) -> None:
    """Register the allowed values of the setting ``blockflow.<key>``.

    :func:`validate` checks the key against them as its JSON schema ``enum``;
    registering again replaces the earlier choices.

    Parameters
    ----------
    key : str
        Key below the ``blockflow.`` namespace, e.g. ``"cluster.policy"``.
    values : sequence of str
        The allowed values, in the order messages list them.
    pattern : str, optional
        A regular expression other values may match instead (e.g. a dotted path).

    Raises
    ------
    KeyError
        If ``blockflow-schema.yaml`` has no such key.
    """
    _schema_node(_load_schema(), key)  # an unknown key is a programming error: fail now
    _choices[key] = tuple(values)
    _patterns.pop(key, None)
    if pattern is not None:
        _patterns[key] = pattern


def get(key: str, value: Any = None) -> Any:
    """Return ``value`` unless it is None, else the setting ``blockflow.<key>``
    (``key`` below the namespace, e.g. ``"reduction.split-every"``)."""
    if value is not None:
        return value
    return dask.config.get(f"blockflow.{key}")


def validate(config: dict | None = None) -> None:
    """Check blockflow's settings against ``blockflow-schema.yaml``.

    Types, allowed values, ranges, durations, sizes, unknown keys, ``x-ordered`` rules and
    the choices registered with :func:`set_choices`.

    Parameters
    ----------
    config : dict, optional
        A mapping with a top-level ``"blockflow"`` key; default the current ``dask.config``
        settings.

    Raises
    ------
    ValueError
        If a setting is invalid: the key, its value, where it was set and what is allowed.

    Warns
    -----
    BlockflowWarning
        Once per environment variable that looks like a blockflow setting but that Dask does
        not read (:func:`unread_variables`).
    """
    if config is None:
        _warn_unread_variables()
        replaced = _replaced_sections(_user_settings, defaults["blockflow"])
        if replaced is not None:  # set to a non-mapping before import, hidden by the defaults
            _raise_first_problem({"blockflow": replaced}, _schema())
        current = dask.config.get("blockflow")
        if current == defaults["blockflow"]:
            return  # the packaged defaults are valid (a test checks them): load no schema
        config = {"blockflow": current}
    _raise_first_problem(config, _schema())


def variable_names() -> dict[str, str]:
    """The environment variable of every blockflow setting, e.g.
    ``{"DASK_BLOCKFLOW__CLUSTER__POLICY": "cluster.policy", ...}`` (from the defaults)."""
    names = {}

    def walk(node: dict, path: list[str]) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, path + [key])
            else:
                parts = ["DASK_BLOCKFLOW"] + [_env_part(p) for p in path + [key]]
                names["__".join(parts)] = ".".join(path + [key])

    walk(defaults["blockflow"], [])
    return names


def _squash(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


def unread_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One-line messages for environment variables that look like blockflow settings but
    that Dask does not read (``DASK_BLOCKFLOW_CLUSTER__POLICY``, ``BLOCKFLOW__...``).

    Parameters
    ----------
    environ : mapping, optional
        Default ``os.environ``.

    Returns
    -------
    list of str
        One message per variable, sorted by name.
    """
    environ = os.environ if environ is None else environ
    names = variable_names()
    by_letters = {_squash(n): n for n in names}
    out = []
    for name in sorted(environ):
        if name.startswith("DASK_") and (name[5:].lower() == "blockflow"
                                         or name[5:].lower().startswith("blockflow__")):
            continue  # read: validate() checks its key and value
        squashed = _squash(name)
        meant = by_letters.get(squashed) or by_letters.get("DASK" + squashed)
        if meant is None and not (squashed.startswith("DASK") and "BLOCKFLOW" in squashed):
            continue
        if meant is None:
            close = difflib.get_close_matches(name.upper(), list(names), n=1, cutoff=0.8)
            meant = close[0] if close else None
        hint = (f"; did you mean {meant}?" if meant else
                f"; the settings and their names are in {DEFAULTS_PATH}")
        out.append(
            f"blockflow: the environment variable {name}={environ[name]!r} is not read, so it "
            f"sets nothing (Dask reads DASK_BLOCKFLOW__<SECTION>__<KEY>: upper-case DASK_, "
            f"then two underscores between the parts){hint}")
    return out


_warned: set[str] = set()  # messages given (once per process)


def _warn_unread_variables() -> None:
    for message in unread_variables():
        if message not in _warned:
            _warned.add(message)
            warnings.warn(message, BlockflowWarning, stacklevel=3)


def _raise_first_problem(config: dict, schema: dict) -> None:
    config = _kebab_keys(config)
    problem = _first_problem(config, schema)
    if problem is not None:
        path, value, text = problem
        where, entry = _where(path, config)
        if entry is not None:  # inside a list (blockflow.pools): the list's source
            path = path[:entry]
            value = _lookup(config, ".".join(path))
        raise ValueError(
            f"Invalid blockflow setting {where}{_source(path, value)}: {text}. "
            f"See {SCHEMA_PATH} for the allowed values."
        ) from None


def _where(path: list[str], config: dict) -> tuple[str, int | None]:
    """``'blockflow.pools[1].price' of pool 'fast'`` for a path into a list of named entries,
    and the index in ``path`` of the first list position (None outside lists)."""
    node: Any = config
    text, entry, name = "", None, None
    for i, part in enumerate(path):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            text += f"[{part}]"
            node = node[int(part)]
            if entry is None:
                entry = i
                if isinstance(node, dict) and isinstance(node.get("name"), str):
                    name = node["name"]
            continue
        text += ("." if text else "") + part
        node = node.get(part) if isinstance(node, dict) else None
    text = repr(text or "blockflow")
    return (f"{text} of pool {name!r}" if name else text), entry


def _replaced_sections(user: Any, default: Any) -> Any:
    """The user's settings that replaced a section of ``default`` by a non-mapping, or None."""
    if not isinstance(default, dict):
        return None
    if not isinstance(user, dict):
        return user if user is not None else None
    found = {}
    for key, value in _kebab_keys(user).items():
        sub = _replaced_sections(value, default.get(key))
        if sub is not None:
            found[key] = sub
    return found or None


def _load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return yaml.safe_load(f)


def _schema_node(schema: dict, key: str) -> dict:
    node = schema["properties"]["blockflow"]
    for part in key.split("."):
        node = node["properties"][part]
    return node


def _schema() -> dict:
    """``blockflow-schema.yaml`` with the registered choices as the ``enum`` of their keys."""
    schema = _load_schema()
    for key, values in _choices.items():
        node = _schema_node(schema, key)
        if key in _patterns:
            node["anyOf"] = [{"enum": list(values)}, {"pattern": _patterns[key]}]
        else:
            node["enum"] = list(values)
    return schema


def _first_problem(config: Any, schema: dict) -> tuple[list[str], Any, str] | None:
    """``(path, value, what is wrong)`` of the first invalid setting, or None."""
    jsonschema = _import_jsonschema()

    error = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for(schema)(schema).iter_errors(config))
    if error is not None:
        return _describe(error)
    return next(_rule_problems(config, schema, []), None)


def _import_jsonschema():
    """``import jsonschema`` with ``rfc3987_syntax`` imported lazily (slow import)."""
    if ("jsonschema" in sys.modules or "rfc3987_syntax" in sys.modules
            or importlib.util.find_spec("rfc3987_syntax") is None):
        import jsonschema

        return jsonschema

    def _real():
        import rfc3987_syntax  # the real module: the stand-in has left sys.modules

        return rfc3987_syntax

    def is_valid_syntax(*args, **kwargs):
        return _real().is_valid_syntax(*args, **kwargs)

    def __getattr__(name):
        if name.startswith("__") or sys.modules.get("rfc3987_syntax") is stand_in:
            raise AttributeError(name)  # the import machinery's look-ups, during the import
        return getattr(_real(), name)

    stand_in = types.ModuleType("rfc3987_syntax", "Stand-in: imports rfc3987_syntax on use.")
    stand_in.is_valid_syntax = is_valid_syntax
    stand_in.__getattr__ = __getattr__
    sys.modules["rfc3987_syntax"] = stand_in
    try:
        import jsonschema
    finally:
        if sys.modules.get("rfc3987_syntax") is stand_in:
            del sys.modules["rfc3987_syntax"]
    return jsonschema


def _describe(error) -> tuple[list[str], Any, str]:
    """A JSON schema error as ``(path, value, text)``, in words for sections and keys."""
    path = [str(p) for p in error.absolute_path]
    where = ".".join(path) or "blockflow"
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = list(error.schema.get("properties", {}))
        key = sorted((k for k in error.instance if k not in known), key=str)[0]
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (path + [str(key)], error.instance[key],
                f"{error.instance[key]!r} is set for an unknown key{hint}; {where!r} has the "
                f"keys {', '.join(known)}")
    if error.validator == "anyOf" and any("pattern" in b for b in error.validator_value):
        # a name or a dotted path (policy): the names, as an enum's message gives them
        names = [v for b in error.validator_value for v in b.get("enum", [])]
        return path, error.instance, f"{error.instance!r} is not one of {names!r}"
    if error.validator in ("oneOf", "anyOf"):  # e.g. gpu: a boolean or "auto"
        allowed = []
        for branch in error.validator_value:
            if branch.get("type") == "boolean":
                allowed += ["true", "false"]
            allowed += [repr(v) for v in branch.get("enum", [])]
        if allowed:
            return path, error.instance, f"{error.instance!r} is not one of {', '.join(allowed)}"
    types = error.validator_value if error.validator == "type" else None
    if types == "object" or (isinstance(types, list) and "object" in types):
        known = list(error.schema.get("properties", {}))
        example, sub = list(path), error.schema
        while sub.get("properties"):  # down to the first setting, e.g. ...__CLUSTER__GPU
            key, sub = next(iter(sub["properties"].items()))
            example.append(key)
        example = "DASK_" + "__".join(_env_part(p) for p in example)
        return (path, error.instance,
                f"{error.instance!r} is not a mapping: {where!r} is a section of settings "
                f"({', '.join(known)}); set them one at a time, e.g. {example}")
    return path, error.instance, error.message


def _rule_problems(node: Any, schema: dict, path: list[str]
                   ) -> Iterator[tuple[list[str], Any, str]]:
    """blockflow's ``x-`` rules of the schema (the JSON schema checks have passed)."""
    if isinstance(node, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(node):
            yield from _rule_problems(item, schema["items"], path + [str(i)])
        return
    if not isinstance(node, dict):
        return
    for key, sub in schema.get("properties", {}).items():
        value = node.get(key, _MISSING)
        if value is _MISSING:
            continue
        text = None
        if "x-duration" in sub:
            text = _duration_problem(value, sub["x-duration"])
        elif "x-bytes" in sub:
            text = _bytes_problem(value)
        if text is not None:
            yield path + [key], value, text
        yield from _rule_problems(value, sub, path + [key])
    for rule in schema.get("x-ordered", []):
        yield from _order_problem(node, path, rule)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _duration_problem(value: Any, rule: str) -> str | None:
    if not (_is_number(value) or isinstance(value, str)):
        return None  # a wrong type: the JSON schema's "type" reports it
    try:
        seconds = parse_timedelta(value)
    except (ValueError, KeyError, TypeError):
        seconds = None
    if seconds is not None and math.isfinite(seconds) and (
            seconds > 0 or (seconds == 0 and rule == "non-negative")):
        return None
    bound = "above 0" if rule == "positive" else "of 0 or more"
    return (f"{value!r} is not a duration {bound}; give a number of seconds or a time with a "
            f"unit, e.g. '100ms', '30s' or '1h'")


def _bytes_problem(value: Any) -> str | None:
    if not (_is_number(value) or isinstance(value, str)):
        return None
    try:
        nbytes = parse_bytes(value) if isinstance(value, str) else value
    except (ValueError, TypeError):
        nbytes = None
    if nbytes is not None and math.isfinite(nbytes) and nbytes > 0:
        return None
    return (f"{value!r} is not a size above 0; give a number of bytes or a size with a unit, "
            f"e.g. '128MiB' or '4GB'")


def _order_problem(node: dict, path: list[str], rule: dict
                   ) -> Iterator[tuple[list[str], Any, str]]:
    """``rule["low"]`` must be below (``strict``) or at most ``rule["high"]``."""
    low, high = node.get(rule["low"], _MISSING), node.get(rule["high"], _MISSING)
    if not (_is_number(low) and _is_number(high)):
        return  # one is missing (a partial config) or has a wrong type (reported already)
    strict = rule.get("strict", True)
    if low < high or (low == high and not strict):
        return
    low_path, high_path = path + [rule["low"]], path + [rule["high"]]
    # Blame the setting the user changed; when both or neither were, the low one.
    blame_high = (_default(high_path) != high) and (_default(low_path) == low)
    if blame_high:
        bad_path, bad, other_path, other = high_path, high, low_path, low
        relation = "above" if strict else "at least"
    else:
        bad_path, bad, other_path, other = low_path, low, high_path, high
        relation = "below" if strict else "at most"
    yield (bad_path, bad,
           f"{bad!r} must be {relation} {'.'.join(other_path)!r} "
           f"({other!r}{_other_source(other_path, other)}); {rule['why']}")


def _other_source(path: list[str], value: Any) -> str:
    source = _source(path, value)
    if source:
        return ", " + source[2:-1]  # " (from ...)" -> ", from ..."
    return ", the default" if _default(path) == value else ""


def _default(path: list[str]) -> Any:
    node: Any = defaults
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _env_part(key: str) -> str:
    return key.upper().replace("-", "_")


def _source(path: list[str], value: Any) -> str:
    """Where ``path`` was set to ``value`` (environment variable or Dask config file), as a
    suffix for messages; else ``""``."""
    key = ".".join(path)
    below = []  # variables that set keys inside ``path`` (a misspelled section, say)
    for name, raw in sorted(os.environ.items()):
        if not name.startswith("DASK_") or name == "DASK_INTERNAL_INHERIT_CONFIG":
            continue
        found = _lookup(dask.config.collect_env({name: raw}), key)
        if found is _MISSING:
            continue
        if isinstance(value, dict) and name.count("__") >= len(path):
            below.append(f"{name}={raw!r}")
        elif _same(found, value):
            return f" (from the environment variable {name}={raw!r})"
    if below:
        s = "s" if len(below) > 1 else ""
        return f" (from the environment variable{s} {', '.join(below)})"
    try:
        for file, settings in dask.config.collect_yaml(dask.config.paths, return_paths=True):
            found = _lookup(settings, key)
            if found is not _MISSING and _same(found, value):
                return f" (from the Dask config file {file})"
    except ValueError:  # a file made malformed since dask read it
        pass
    return ""


def _lookup(settings: dict, key: str) -> Any:
    try:
        return dask.config.get(key, config=settings)
    except (KeyError, TypeError):
        return _MISSING


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(_kebab_keys(a) == b)
    except Exception:  # exotic values that do not compare: attribute anyway
        return True


def _kebab_keys(config: Any) -> Any:
    """Keys with ``_`` spelled ``-`` (environment variables arrive as ``hot_high``), also in
    the mappings of a list (``blockflow.pools``); where both exist the ``-`` one wins, as in
    ``dask.config.get``."""
    if isinstance(config, list):
        return [_kebab_keys(v) for v in config]
    if not isinstance(config, dict):
        return config
    out: dict[Any, Any] = {}
    for k, v in config.items():
        kebab = k.replace("_", "-") if isinstance(k, str) else k
        if kebab in out and kebab != k:
            continue  # the exact "-" key, seen first or later, wins
        out[kebab] = _kebab_keys(v)
    return out
