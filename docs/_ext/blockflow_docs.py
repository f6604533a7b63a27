"""Pages generated at build time: the API reference, the configuration reference and the
benchmark pages.

The API reference has one page per public module (:data:`API_MODULES`, and each public module
of :mod:`blockflow.workloads`) listing every name of its ``__all__`` in an ``autosummary``
table, so a name added to ``__all__`` is documented without editing the docs (autosummary
then writes one page per name into ``docs/api/generated/``); its index page repeats the
tables, each name with its one-line summary, under each module's own summary.

The configuration reference is read from ``blockflow/blockflow-schema.yaml`` (types,
descriptions, blockflow's own ``x-`` rules) and ``blockflow/blockflow.yaml`` (defaults and
their comments), so it cannot drift from the settings blockflow validates. The benchmark
pages pair each script in ``benchmarks/`` (its module docstring says what it measures) with
its stored results in ``benchmarks/results/`` (``<script>-<cpu|gpu>-<date>[-note].txt``),
newest first, and the index lists each script with what it measures. All are written under
the source tree before Sphinx (and autosummary) reads it: ``docs/_generated/`` (included,
never a page of its own), ``docs/api/modules/`` and ``docs/benchmarks/generated/``; none is
committed.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
from typing import Any

import yaml

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(DOCS)
SCHEMA = os.path.join(ROOT, "blockflow", "blockflow-schema.yaml")
DEFAULTS = os.path.join(ROOT, "blockflow", "blockflow.yaml")
BENCHMARKS = os.path.join(ROOT, "benchmarks")
RESULTS = os.path.join(BENCHMARKS, "results")


# -- API reference -------------------------------------------------------------------------

API_MODULES = ["blockflow", "blockflow.ml", "blockflow.tune", "blockflow.parallel",
               "blockflow.scheduling", "blockflow.cluster.hpc", "blockflow.cluster.kubernetes",
               "blockflow.config", "blockflow.io", "blockflow.dashboard", "blockflow.testing"]


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:  # defined here, not imported
        names = [n for n, o in vars(module).items() if not n.startswith("_")
                 and getattr(o, "__module__", None) == module.__name__ and callable(o)]
    return sorted(names)


def api_modules() -> list[str]:
    import blockflow.workloads

    workloads = [f"blockflow.workloads.{m.name}"
                 for m in pkgutil.iter_modules(blockflow.workloads.__path__)
                 if not m.name.startswith("_")]
    return API_MODULES + sorted(workloads)


def api_names(name: str) -> tuple[list[str], list[str]]:
    """The public names of module ``name`` documented on its page, and those documented at
    the top level instead: a re-export of a top-level name is documented once (one object,
    one page: two would describe the same canonical object twice)."""
    module = importlib.import_module(name)
    names = _public_names(module)
    top = importlib.import_module("blockflow")
    again = [n for n in names if name != "blockflow" and n in top.__all__
             and getattr(module, n) is getattr(top, n)]
    return [n for n in names if n not in again], again


def api_page(name: str) -> str:
    title = f"``{name}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {name}", "   :no-members:", "",
             f".. currentmodule:: {name}", "", ".. autosummary::", "   :toctree: ../generated",
             ""]
    names, again = api_names(name)
    lines += [f"   {n}" for n in names]
    if again:
        lines += ["", "Also here, documented at the top level: " + ", ".join(
            f":obj:`{n} <blockflow.{n}>`" for n in again) + "."]
    return "\n".join(lines) + "\n"


def _summary(name: str) -> str:
    """The first paragraph of module ``name``'s docstring, on one line."""
    doc = (importlib.import_module(name).__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def api_index(modules: list[str]) -> str:
    """The API index: per module its summary and a table of its names with theirs."""
    lines = [".. toctree::", "   :hidden:", ""]
    lines += [f"   {m} <modules/{m}>" for m in modules] + [""]  # plain titles: they wrap
    for name in modules:
        names, again = api_names(name)
        lines += [name, "-" * len(name), "",
                  f"{_summary(name)} (:mod:`module page <{name}>`)", "",
                  f".. currentmodule:: {name}", ""]
        if names:
            lines += [".. autosummary::", "   :nosignatures:", ""]
            lines += [f"   {n}" for n in names] + [""]
        if again:
            lines += ["Also here, documented at the top level: " + ", ".join(
                f":obj:`{n} <blockflow.{n}>`" for n in again) + ".", ""]
    return "\n".join(lines)


# -- configuration reference ---------------------------------------------------------------


def _env_var(path: list[str]) -> str:
    # Dask reads DASK_ + the key's parts joined by "__", "-" written "_" (blockflow.config)
    return "__".join(["DASK_BLOCKFLOW"] + [p.upper().replace("-", "_") for p in path])


def _type(node: dict[str, Any]) -> str:
    if "oneOf" in node or "anyOf" in node:
        return " or ".join(_type(n) for n in node.get("oneOf", node.get("anyOf")))
    if "enum" in node:
        return "one of " + ", ".join(f"``{_literal(v)}``" for v in node["enum"])
    kinds = node.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    text = " or ".join(k for k in kinds)
    if "x-duration" in node:
        text += f" (duration, {node['x-duration']})"
    if "x-bytes" in node:
        text += f" (bytes, {node['x-bytes']})"
    bounds = [f"{op} {node[k]}" for k, op in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                              ("maximum", "<="), ("exclusiveMaximum", "<"))
              if k in node]
    if bounds:
        text += ", " + ", ".join(bounds)
    return text


def _literal(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _yaml_comments(path: str) -> dict[tuple[str, ...], str]:
    """The comment lines just above each key of the defaults file, by key path."""
    comments: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    with open(path) as f:
        for line in f:
            stripped = line.strip()
            if not stripped:
                pending = []
                continue
            if stripped.startswith("#"):
                pending.append(stripped.lstrip("#").strip())
                continue
            match = re.match(r"(\s*)([\w-]+):", line)
            if not match:
                continue
            indent = len(match.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, match.group(2))]
            if pending:
                comments[tuple(k for _, k in stack)] = " ".join(pending)
            pending = []
    return comments


def _cell(text: str) -> str:
    return text.strip() or "\\-"


def _adds_to(comment: str, description: str) -> bool:
    """Whether a comment of the defaults file says more than the schema's description."""
    words = set(re.findall(r"[a-z0-9]+", comment.lower()))
    new = words - set(re.findall(r"[a-z0-9]+", description.lower()))
    return len(new) > 0.4 * len(words)


def configuration_table() -> str:
    with open(SCHEMA) as f:
        schema = yaml.safe_load(f)
    with open(DEFAULTS) as f:
        defaults = yaml.safe_load(f)
    comments = _yaml_comments(DEFAULTS)
    out: list[str] = []

    def section(node: dict, values: dict, path: list[str]) -> None:
        leaves = {k: v for k, v in node["properties"].items() if "properties" not in v}
        if leaves:
            title = ".".join(["blockflow", *path])
            out.extend([title, "-" * len(title), ""])
            for rule in node.get("x-ordered", []):
                relation = "below" if rule.get("strict", True) else "at most"
                out.append(f"``{rule['low']}`` must be {relation} ``{rule['high']}``: "
                           f"{rule['why']}.")
                out.append("")
            out.extend([".. list-table::", "   :header-rows: 1", "   :widths: 18 16 12 34 20",
                        "", "   * - key", "     - type", "     - default",
                        "     - description", "     - environment variable"])
            for key, leaf in leaves.items():
                full = path + [key]
                description = leaf.get("description", "")
                comment = comments.get(("blockflow", *full), "")
                if _adds_to(comment, description):  # the defaults file says more
                    description = f"{description}\n\n       {comment}".strip()
                default = _literal(values.get(key)) if key in values else "(none)"
                out.extend([f"   * - ``{key}``", f"     - {_cell(_type(leaf))}",
                            f"     - ``{default}``", f"     - {_cell(description)}",
                            f"     - ``{_env_var(full)}``"])
            out.append("")
        for key, sub in node["properties"].items():
            if "properties" in sub:
                section(sub, values.get(key, {}), path + [key])

    # blockflow's own leaves (the list blockflow.pools) first, then each section
    section(schema["properties"]["blockflow"], defaults["blockflow"], [])
    return "\n".join(out) + "\n"


# -- benchmark pages -----------------------------------------------------------------------


def _results_by_script() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in os.listdir(RESULTS) if os.path.isdir(RESULTS) else []:
        match = re.match(r"([a-z_]+?)-(cpu|gpu)-(\d{4}-\d{2}-\d{2})", name)
        if match:
            found.setdefault(match.group(1), []).append(name)
    for names in found.values():  # newest first: by date in the name, then modification
        names.sort(key=lambda n: (re.search(r"\d{4}-\d{2}-\d{2}", n).group(0),
                                  os.path.getmtime(os.path.join(RESULTS, n))), reverse=True)
    return found


def benchmark_page(script: str, results: list[str]) -> str:
    with open(os.path.join(BENCHMARKS, script + ".py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    first, _, rest = doc.partition("\n")
    title = f"``benchmarks/{script}.py``"
    lines = [f".. _benchmark-{script}:", "", title, "=" * len(title), "", first.strip(), ""]
    lines += [rest.strip(), ""]
    lines += ["", "Results", "-------", ""]
    if not results:
        lines += ["No results are stored for this script: it is run by hand where its "
                  "hardware is (see above).", ""]
    else:
        lines += [f"{len(results)} stored result file(s) in ``benchmarks/results/``, newest "
                  "first; each starts with the command and machine it was measured on.", ""]
    for name in results:
        lines += [f"``{name}``", "~" * (len(name) + 4), ""]
        if name.endswith(".png"):  # a plot the script drew beside its table
            lines += [f".. image:: ../../../benchmarks/results/{name}",
                      f"   :alt: {name}", ""]
        else:
            lines += [f".. literalinclude:: ../../../benchmarks/results/{name}",
                      "   :language: text", ""]
    return "\n".join(lines)


def benchmarks_index(scripts: list[str]) -> str:
    """The benchmark index: each script with its docstring's first paragraph."""
    lines = [".. toctree::", "   :hidden:", ""]
    lines += [f"   {s}.py <generated/{s}>" for s in scripts]
    lines += ["", ".. list-table::", "   :header-rows: 1", "", "   * - script",
              "     - what it measures"]
    for script in scripts:
        with open(os.path.join(BENCHMARKS, script + ".py")) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        lines += [f"   * - :ref:`{script}.py <benchmark-{script}>`",
                  f"     - {_cell(' '.join(doc.split(chr(10) * 2)[0].split()))}"]
    return "\n".join(lines) + "\n"


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return  # unchanged: Sphinx need not reread it
    with open(path, "w") as f:
        f.write(text)


def generate(app=None, config=None) -> None:
    modules = api_modules()
    folder = os.path.join(DOCS, "api", "modules")
    for name in modules:
        _write(os.path.join(folder, name + ".rst"), api_page(name))
    _prune(folder, {m + ".rst" for m in modules})
    stubs = os.path.join(DOCS, "api", "generated")  # autosummary's; drop names gone
    if os.path.isdir(stubs):
        _prune(stubs, {f"{m}.{n}.rst" for m in modules for n in api_names(m)[0]})
    _write(os.path.join(DOCS, "_generated", "api-index.rst"), api_index(modules))
    if config is not None:  # autosummary reads these pages, listed now, not the old ones
        config.autosummary_generate = [f"api/modules/{m}.rst" for m in modules]
    _write(os.path.join(DOCS, "_generated", "configuration-table.rst"), configuration_table())
    results = _results_by_script()
    scripts = sorted(n[:-3] for n in os.listdir(BENCHMARKS)
                     if n.endswith(".py") and not n.startswith("_"))
    out = os.path.join(DOCS, "benchmarks", "generated")
    for script in scripts:
        _write(os.path.join(out, script + ".rst"), benchmark_page(script, results.get(script, [])))
    _prune(out, {s + ".rst" for s in scripts})
    _write(os.path.join(DOCS, "_generated", "benchmarks-index.rst"), benchmarks_index(scripts))


def _prune(folder: str, keep: set[str]) -> None:
    for stale in set(os.listdir(folder)) - keep:
        os.remove(os.path.join(folder, stale))


def setup(app):
    app.connect("config-inited", generate)  # before Sphinx lists the source files
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
