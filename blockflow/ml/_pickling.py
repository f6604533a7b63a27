"""Whether a model can be shipped to the workers, and if not, which attribute stops it.

Entry points that send a model to workers serialise it through :func:`dumps_or_explain`
(``cloudpickle``, as distributed does) before anything is scheduled; a refusal names the
attribute path that cannot be pickled.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import cloudpickle

from blockflow.errors import describe

__all__ = ["dumps_or_explain", "unpicklable_path"]

#: How deep :func:`unpicklable_path` follows attributes, items and closures.
MAX_DEPTH = 12

#: nn.Module's containers of named children: their items are shown as attributes.
_NAMED_CONTAINERS = ("_modules", "_parameters", "_buffers")

#: The fix where blockflow can build the model on the workers (predict, Router).
FIX = ("give blockflow a factory that builds the model on the worker, or its state_dict: "
       "blockflow.ml.inference.ModelFactory(build, state_dict=model.state_dict()); or drop "
       "the attribute in the model's __getstate__")

#: The fix where the model itself must travel (DataParallelTrainer trains it in place).
FIX_TRAIN = ("build the model without it (or drop it in the model's __getstate__) and load "
             "its state_dict into that one")


def _dumps(obj) -> bytes:
    # cloudpickle accepts what distributed's pickler accepts (it falls back to cloudpickle)
    # without logging each failure
    return cloudpickle.dumps(obj)


def _picklable(obj, dumps) -> BaseException | None:
    try:
        dumps(obj)
    except Exception as e:  # noqa: BLE001 (pickling raises TypeError, PicklingError, ...)
        return e
    return None


def _children(obj, path: str):
    """(path, child) of what pickling ``obj`` pickles: items, state, closure cells."""
    if isinstance(obj, dict):
        return [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, types.FunctionType):
        cells = zip(obj.__code__.co_freevars, obj.__closure__ or ())
        out = []
        for name, cell in cells:
            try:
                out.append((f"{path}.__closure__[{name!r}]", cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        return out
    try:
        state = obj.__getstate__() if hasattr(obj, "__getstate__") else vars(obj)
    except Exception:  # noqa: BLE001 (a __getstate__ that fails: the object itself)
        return []
    if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a __slots__ class
        state = {**(state[0] or {}), **(state[1] or {})}
    if not isinstance(state, dict):
        return [(f"{path}.__getstate__()", state)] if state is not None else []
    out = []
    for k, v in state.items():
        if k in _NAMED_CONTAINERS and isinstance(v, dict):  # nn.Module: model.layer.fn
            out += [(f"{path}.{name}", child) for name, child in v.items()]
        else:
            out.append((f"{path}.{k}", v))
    return out


def unpicklable_path(obj: Any, root: str = "model", *, dumps: Callable | None = None,
                     max_depth: int = MAX_DEPTH) -> tuple[str, Any, BaseException] | None:
    """``(path, value, error)`` of the deepest attribute of ``obj`` that cannot be pickled
    (path like ``"model.transform_.fn"``); None if ``obj`` can be. A blockflow heuristic.
    """
    dumps = dumps or _dumps
    err = _picklable(obj, dumps)
    if err is None:
        return None
    path, seen = root, {id(obj)}
    for _ in range(max_depth):
        for child_path, child in _children(obj, path):
            if id(child) in seen:
                continue
            child_err = _picklable(child, dumps)
            if child_err is not None:
                seen.add(id(child))
                obj, path, err = child, child_path, child_err
                break
        else:
            break  # no child fails: this object itself cannot be pickled
    return path, obj, err


def dumps_or_explain(model: Any, entry: str, *, dumps: Callable | None = None,
                     root: str = "model", fix: str | None = None) -> bytes:
    """``model`` serialised by ``dumps`` (default cloudpickle) for shipping.

    Raises
    ------
    TypeError
        Naming the attribute path (:func:`unpicklable_path`) and ``fix`` (default
        :data:`FIX`).
    """
    dumps = dumps or _dumps
    try:
        return dumps(model)
    except Exception as e:  # noqa: BLE001
        found = unpicklable_path(model, root, dumps=dumps) or (root, model, e)
        path, value, err = found
        raise TypeError(
            f"{entry}: cannot ship the model to the workers: {path} is a {describe(value)} "
            f"that cannot be pickled ({type(err).__name__}: {err}); {fix or FIX}."
        ) from e
