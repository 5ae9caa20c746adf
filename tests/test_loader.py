"""Plan loading: YAML and TOML, positions, schema errors with file:line, and fuzzing."""

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan.plan.loader import parse_plan
from shardplan.plan.schema import Plan, normalize_spec

from conftest import PLANS

GOOD = """\
version: 1
mesh:
  axes: {data: 4, model: 2}
inputs:
  tokens: [data, null]
params:
  - match: 'a/kernel'
    spec: [null, model]
  - match: '.*'
    spec: replicated
"""


def errors_of(exc_info) -> list:
    return exc_info.value.diagnostics


def test_yaml_plan_loads_with_rule_lines(write_plan):
    plan = shardplan.load_plan(write_plan(GOOD))
    assert plan.mesh.axes == {"data": 4, "model": 2}
    assert normalize_spec(plan.params[0].spec) == (None, ("model",))
    assert plan.locate("params", 0, "match") == (7, 5)
    assert plan.locate("params", 1, "spec") == (10, 5)


def test_toml_plan_has_same_structure_and_lines(write_plan):
    text = """\
version = 1
[mesh]
axes = {data = 4, model = 2}
[inputs]
tokens = ["data", "_"]

[[params]]
match = 'a/kernel'
spec = ["_", "model"]

[[params]]
match = '.*'
spec = "replicated"
"""
    plan = shardplan.load_plan(write_plan(text, "plan.toml"))
    assert normalize_spec(plan.params[0].spec) == (None, ("model",))
    assert normalize_spec(plan.inputs["tokens"]) == (("data",), None)
    assert plan.locate("params", 0, "match")[0] == 8
    assert plan.locate("params", 1, "spec")[0] == 13
    assert plan.locate("mesh", "axes", "data")[0] == 3


def test_shipped_toml_and_yaml_forms_agree():
    toml_plan = shardplan.load_plan(PLANS / "minigpt_fsdp.toml")
    assert toml_plan.mesh.axes == {"data": -1}
    assert toml_plan.locate("params", 2, "match")[0] > toml_plan.locate("params", 1, "match")[0]


@pytest.mark.parametrize(
    "text, code, line, needle",
    [
        (
            "version: 1\nmesh:\n  axs: {data: 8}\nparams: [{match: '.*', spec: replicated}]\n",
            "unknown-key",
            3,
            "did you mean 'axes'",
        ),
        (
            "version: 1\nmesh: {axes: {data: 8}}\nparams:\n  - {match: '.*', spec: replicated, rule: 2}\n",
            "unknown-key",
            4,
            "params[0].rule",
        ),
        ("version: 1\nmesh: {axes: {data: 8}}\n", "missing-key", None, "'params'"),
        (
            "version: 1\nmesh: {axes: {data: 8}}\nparams: [{match: '.*', spec: replicated}]\nunmatched: eror\n",
            "invalid-value",
            4,
            "did you mean 'error'",
        ),
        (
            "version: 1\nmesh: {axes: {data: 8}}\nparams:\n  - match: x\n    spec: [null, 3]\n",
            "invalid-value",
            5,
            "got 3",
        ),
        (
            "version: 1\nmesh: {axes: {data: -1, model: -1}}\nparams: [{match: '.*', spec: replicated}]\n",
            "invalid-value",
            2,
            "at most one mesh axis",
        ),
        (
            "version: 2\nmesh: {axes: {data: 8}}\nparams: [{match: '.*', spec: replicated}]\n",
            "invalid-value",
            1,
            "version",
        ),
        (
            "version: 1\nmesh: {axes: {data: 8}}\nmesh: {axes: {data: 4}}\nparams: [{match: '.*', spec: []}]\n",
            "duplicate-key",
            3,
            "'mesh'",
        ),
        ("version: 1\nmesh: {axes: {data: 8}\nparams: []\n", "syntax-error", 3, "invalid YAML"),
        ("- just\n- a list\n", "invalid-value", 1, "mapping"),
    ],
)
def test_structural_mistakes_give_code_line_and_culprit(write_plan, text, code, line, needle):
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.load_plan(write_plan(text))
    found = [d for d in errors_of(exc) if d.code == code]
    assert found, [d.format() for d in errors_of(exc)]
    text_of = " ".join(d.message + " " + (d.hint or "") for d in found)
    assert needle in text_of
    if line is not None:
        assert found[0].line == line
    assert found[0].file.endswith("plan.yaml")


def test_toml_syntax_error_has_line(write_plan):
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.load_plan(write_plan("version = 1\n[mesh\naxes = 3\n", "plan.toml"))
    (diag,) = errors_of(exc)
    assert diag.code == "syntax-error" and diag.line == 2


def test_toml_unknown_key_has_line(write_plan):
    text = 'version = 1\n[mesh]\naxes = {data = 8}\n\n[[params]]\nmatch = ".*"\nspek = "replicated"\n'
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.load_plan(write_plan(text, "plan.toml"))
    unknown = [d for d in errors_of(exc) if d.code == "unknown-key"]
    assert unknown[0].line == 7 and "did you mean 'spec'" in unknown[0].hint


def test_unreadable_and_unsupported_files(tmp_path):
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.load_plan(tmp_path / "missing.yaml")
    assert errors_of(exc)[0].code == "unreadable-file"
    other = tmp_path / "plan.json"
    other.write_text("{}")
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.load_plan(other)
    assert errors_of(exc)[0].code == "unsupported-format"


def test_yaml_is_loaded_safely(write_plan):
    text = GOOD.replace("version: 1", "version: !!python/object/apply:os.system ['echo pwned']")
    with pytest.raises(shardplan.PlanError) as exc:
        shardplan.load_plan(write_plan(text))
    assert errors_of(exc)[0].code == "syntax-error"


def test_schema_is_json_with_descriptions():
    schema = Plan.model_json_schema()
    assert schema["additionalProperties"] is False
    assert "description" in schema["properties"]["params"]
    json.dumps(schema)


# ---------------------------------------------------------------- property-based: only PlanError escapes

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10),
    st.text(max_size=8),
    st.sampled_from(["data", "model", ".*", "replicated", "_", "(", "[0-", "even"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["match", "spec", "axes", "data", "model", "tokens", "stage", "x"]), inner, max_size=4
        ),
    ),
    max_leaves=12,
)
_keys = st.sampled_from(
    ["version", "name", "model", "mesh", "inputs", "params", "unmatched", "optimizer", "pipeline", "paramz"]
)


def _mutations(base: dict):
    return st.dictionaries(_keys, _values, max_size=5).map(lambda extra: {**base, **extra})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=st.one_of(_values, _mutations(yaml.safe_load(GOOD))), fmt=st.sampled_from(["yaml", "toml"]))
def test_loader_only_raises_plan_error(document, fmt):
    text = yaml.safe_dump(document) if fmt == "yaml" else _to_tomlish(document)
    try:
        parse_plan(text, file="fuzz", fmt=fmt)
    except shardplan.PlanError:
        pass


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_loader_survives_arbitrary_text(text):
    for fmt in ("yaml", "toml"):
        try:
            parse_plan(text, file="fuzz", fmt=fmt)
        except shardplan.PlanError:
            pass


def _to_tomlish(document) -> str:
    """A rough TOML rendering (inline values as JSON) so the TOML path sees structured, often invalid, input."""
    if not isinstance(document, dict):
        return json.dumps(document)
    return "\n".join(f"{key} = {json.dumps(value)}" for key, value in document.items())
