"""blockflow's configuration: YAML defaults, schema, dask.config integration."""

from __future__ import annotations

import os
import subprocess
import sys

import dask.config
import pytest
import yaml

import blockflow
from blockflow import config


def _keys(d, prefix=""):
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, prefix + k + ".")
    return out


def _schema_keys(s, prefix=""):
    out = set()
    for k, v in s.get("properties", {}).items():
        out.add(prefix + k)
        if v.get("type") == "object":
            out |= _schema_keys(v, prefix + k + ".")
    return out


def test_defaults_validate_against_schema():
    with open(config.DEFAULTS_PATH) as f:
        defaults = yaml.safe_load(f)
    config.validate(defaults)


def test_yaml_and_schema_list_the_same_keys():
    with open(config.DEFAULTS_PATH) as f:
        defaults = yaml.safe_load(f)
    with open(config.SCHEMA_PATH) as f:
        schema = yaml.safe_load(f)
    assert _keys(defaults) == _schema_keys(schema)


def test_defaults_loaded_on_import():
    assert dask.config.get("blockflow.cluster.policy") == "dynamic"
    assert dask.config.get("blockflow.reduction.memory-fraction") == 0.25


def test_explicit_argument_wins_over_config():
    with dask.config.set({"blockflow.reduction.split-every": 6}):
        assert config.get("reduction.split-every") == 6
        assert config.get("reduction.split-every", 3) == 3


def test_invalid_value_is_rejected_with_the_key_named():
    with dask.config.set({"blockflow.reduction.memory-fraction": 1.5}):
        with pytest.raises(ValueError, match=r"Invalid blockflow setting 'blockflow.reduction."
                                             r"memory-fraction': 1.5 is greater than the maximum"):
            config.validate()


@pytest.mark.slow
def test_environment_variable_override():
    env = dict(os.environ, DASK_BLOCKFLOW__CLUSTER__POLICY="off")
    out = subprocess.run(
        [sys.executable, "-c",
         "import blockflow, dask; print(dask.config.get('blockflow.cluster.policy'))"],
        env=env, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "off"


def test_public_api_is_sorted_and_importable():
    assert blockflow.__all__ == sorted(blockflow.__all__)
    for name in blockflow.__all__:
        assert hasattr(blockflow, name), name


def test_blockflow_rules_of_the_schema_name_its_own_keys():
    """The x- keywords checked by config.validate refer to settings that exist."""
    with open(config.SCHEMA_PATH) as f:
        schema = yaml.safe_load(f)
    # a section of settings, or the items of a list setting (blockflow.pools)
    sections = {name: node.get("items", node)
                for name, node in schema["properties"]["blockflow"]["properties"].items()}
    for section in sections.values():
        keys = section["properties"]
        for rule in section.get("x-ordered", []):
            assert {rule["low"], rule["high"]} <= set(keys) and rule["why"]
        for spec in keys.values():
            assert spec.get("x-duration", "positive") in ("positive", "non-negative")
            assert spec.get("x-bytes", "positive") == "positive"
    durations = {f"{s}.{k}" for s, sec in sections.items()
                 for k, spec in sec["properties"].items() if "x-duration" in spec}
    assert durations == {"cluster.connect-timeout", "cluster.worker-loss-timeout",
                         "cluster.worker-call-timeout",
                         "cluster.worker-start-timeout",
                         "rebalancer.interval", "rebalancer.move-min-gain",
                         "ml.rendezvous-timeout", "ml.collective-timeout",
                         "resources.unsatisfiable-timeout",
                         "resources.admission-grace",
                         "routing.batch-seconds",
                         "routing.interval", "ml.checkpoint-seconds", "scaling.hold",
                         "pools.min-billed"}


def test_policy_choices_come_from_the_registry_not_the_schema_file():
    """The schema file leaves cluster.policy a string; the policy registry supplies the names
    (one registry for the plugin, the schema, the CLI and the dashboard)."""
    from blockflow.scheduling import POLICIES

    with open(config.SCHEMA_PATH) as f:
        policy = yaml.safe_load(f)["properties"]["blockflow"]["properties"]["cluster"][
            "properties"]["policy"]
    assert policy["type"] == "string" and "enum" not in policy
    names, dotted = config._schema_node(config._schema(), "cluster.policy")["anyOf"]
    assert names["enum"] == list(POLICIES) and dotted["pattern"]  # or a dotted path


def test_set_choices_applies_to_validate(monkeypatch):
    monkeypatch.setattr(config, "_choices", {})
    with dask.config.set({"blockflow.cluster.policy": "anything"}):
        config.validate()  # no choices registered: any string passes
        config.set_choices("cluster.policy", ["dynamic", "off"])
        with pytest.raises(ValueError, match=r"^Invalid blockflow setting 'blockflow.cluster."
                                             r"policy': 'anything' is not one of \['dynamic', "
                                             r"'off'\]\. See "):
            config.validate()
    with dask.config.set({"blockflow.cluster.policy": 5}):
        with pytest.raises(ValueError, match="5 is not of type 'string'"):
            config.validate()


def test_set_choices_refuses_an_unknown_key(monkeypatch):
    monkeypatch.setattr(config, "_choices", {})
    with pytest.raises(KeyError):
        config.set_choices("cluster.polcy", ["dynamic"])
    assert config._choices == {}


# --- environment variables that look like settings but are not read ------------------------

NOT_READ = ("is not read, so it sets nothing (Dask reads DASK_BLOCKFLOW__<SECTION>__<KEY>: "
            "upper-case DASK_, then two underscores between the parts)")


@pytest.mark.parametrize("name, meant", [
    ("DASK_BLOCKFLOW_CLUSTER__POLICY", "DASK_BLOCKFLOW__CLUSTER__POLICY"),  # one underscore
    ("dask_blockflow__cluster__gpu", "DASK_BLOCKFLOW__CLUSTER__GPU"),  # lower-case prefix
    ("BLOCKFLOW__REBALANCER__HOT_HIGH", "DASK_BLOCKFLOW__REBALANCER__HOT_HIGH"),  # no DASK_
    ("DASK_BLOCKFLOW_CLUSTER_N_WORKERS", "DASK_BLOCKFLOW__CLUSTER__N_WORKERS"),
    ("DASK_BLOCKFLOWW__CLUSTER__GPU", "DASK_BLOCKFLOW__CLUSTER__GPU"),  # misspelt namespace
])
def test_a_variable_dask_does_not_read_is_named_with_the_one_meant(name, meant):
    assert config.unread_variables({name: "off"}) == [
        f"blockflow: the environment variable {name}='off' {NOT_READ}; did you mean {meant}?"]


def test_variables_that_are_read_or_unrelated_are_not_flagged():
    assert config.unread_variables({
        "DASK_BLOCKFLOW__CLUSTER__POLICY": "off",  # read (a bad key or value: validate())
        "DASK_BLOCKFLOW__CLUSTER__POLICYY": "off",  # read too, as an unknown key: an error
        "DASK_DISTRIBUTED__WORKER__DAEMON": "false",
        "BLOCKFLOW_BOOTSTRAP_NOTE": "/tmp/note",  # blockflow's own, not a setting
        "PATH": "/usr/bin",
    }) == []
    unknown = config.unread_variables({"DASK_BLOCKFLOW_SOMETHING_ELSE": "1"})
    assert unknown == [f"blockflow: the environment variable DASK_BLOCKFLOW_SOMETHING_ELSE='1' "
                       f"{NOT_READ}; the settings and their names are in {config.DEFAULTS_PATH}"]


def test_validate_warns_once_about_a_variable_that_is_not_read(monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    monkeypatch.setenv("DASK_BLOCKFLOW_CLUSTER__POLICY", "off")
    with pytest.warns(blockflow.BlockflowWarning) as record:
        config.validate()
    assert [str(w.message) for w in record] == [
        f"blockflow: the environment variable DASK_BLOCKFLOW_CLUSTER__POLICY='off' {NOT_READ}; "
        f"did you mean DASK_BLOCKFLOW__CLUSTER__POLICY?"]
    assert dask.config.get("blockflow.cluster.policy") == "dynamic"  # indeed not applied
    config.validate()  # once per process: no second warning (they are errors in tests)
    config.validate({"blockflow": {"cluster": {"gpu": True}}})  # explicit config: no warning


def test_public_names_resolve_lazily_to_their_modules_own_objects():
    import importlib

    for name, module in blockflow._LAZY.items():
        assert getattr(blockflow, name) is getattr(importlib.import_module(module), name)
    assert set(blockflow.__all__) == set(blockflow._LAZY)
    assert set(blockflow.__all__) <= set(dir(blockflow))
    assert blockflow.ml.LogisticRegression  # subpackages too, without importing them first
    with pytest.raises(AttributeError, match="module 'blockflow' has no attribute 'nope'"):
        blockflow.nope


@pytest.mark.slow
def test_importing_blockflow_or_its_cli_loads_the_settings_not_distributed():
    # `blockflow --help` answers without importing distributed, and a Ctrl-C while a command
    # starts falls inside the command (its one-line message), not inside an import
    code = ("import sys, dask, blockflow.cli; "
            "print(dask.config.get('blockflow.cluster.policy'), "
            "sorted(m for m in ('distributed', 'blockflow.scheduling', 'torch', 'sklearn') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "dynamic []"


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (no module imported yet) and return its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_BLOCKFLOW")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_defaults_are_not_revalidated_and_jsonschema_stays_unloaded():
    # a scheduler's plugin validates at start: with nothing set, neither jsonschema nor its
    # format checkers (rfc3987-syntax builds a grammar of ~230,000 objects at import) are
    # loaded into the scheduler's heap
    assert _fresh_python(
        "import sys; from blockflow import config; config.validate(); "
        "print(sorted(m for m in ('jsonschema', 'rfc3987_syntax', 'lark') if m in sys.modules))"
    ) == "[]"


def test_a_changed_setting_is_validated_without_rfc3987_syntax():
    code = (
        "import sys, dask\n"
        "from blockflow import config\n"
        "with dask.config.set({'blockflow.rebalancer.interval': 'soon'}):\n"
        "    try:\n"
        "        config.validate()\n"
        "    except ValueError as e:\n"
        "        print('refused:', 'rebalancer.interval' in str(e))\n"
        "print('rfc3987_syntax' in sys.modules, 'rfc3987_syntax' in sys.modules.keys())\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('rfc3987_syntax') is not None:\n"
        "    import rfc3987_syntax  # the block was lifted: it still imports\n"
        "    print('importable', rfc3987_syntax.is_valid_syntax('iri', 'http://x/y'))\n"
    )
    lines = _fresh_python(code).splitlines()
    assert lines[0] == "refused: True"
    assert lines[1] == "False False"
    assert lines[2:] in ([], ["importable True"])


def test_a_scheduler_without_a_dashboard_does_not_load_bokeh():
    code = (
        "import sys\n"
        "from distributed import Client, LocalCluster\n"
        "from blockflow.scheduling.plugin import Rebalancer\n"
        "with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as c, "
        "Client(c) as client:\n"
        "    client.register_plugin(Rebalancer(policy='dynamic'))\n"
        "    assert client.submit(sum, [1, 2]).result() == 3\n"
        "    print('bokeh' in sys.modules)\n"
    )
    assert _fresh_python(code) == "False"


@pytest.mark.slow
def test_a_settings_check_loads_jsonschemas_iri_formats_only_when_one_is_checked():
    """rfc3987_syntax (jsonschema's optional ``iri`` formats) builds a Lark grammar at
    import, 2-3 s of each process's first check: it waits for the first ``iri`` check, which
    still gives jsonschema's answers."""
    pytest.importorskip("rfc3987_syntax")
    # a changed setting: validate() imports jsonschema (the defaults alone skip it)
    code = ("import sys, dask, blockflow.config as c; "
            "dask.config.set({'blockflow.rebalancer.interval': '50ms'}); c.validate(); "
            "print('rfc3987_syntax' in sys.modules, 'jsonschema' in sys.modules); "
            "import jsonschema; f = jsonschema.FormatChecker(); "
            "print(f.conforms('http://example.com/a', 'iri'), "
            "f.conforms('http://exa mple.com/ a', 'iri'), f.conforms('a b', 'iri-reference'), "
            "type(sys.modules['rfc3987_syntax'].is_valid_syntax('iri', 'http://x')).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "True", "True", "False", "False", "bool"], \
        out.stderr
