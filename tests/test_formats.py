"""Plans in the terms users bring: logical axes, and the rule formats of other tools."""

import numpy as np
import pytest
from flax import nnx

import shardplan

from conftest import PLANS


def _specs(plan, model) -> dict:
    report = shardplan.check(plan, model)
    assert report.ok, [d.format() for d in report.errors]
    return {p.path: p.spec for p in report.params}


def test_logical_axes_resolve_and_one_line_adds_fsdp():
    from minigpt_model.llama import Llama
    model = Llama(vocab=128, dim=64, heads=8, kv_heads=2, hidden=128, layers=2, rngs=nnx.Rngs(0))
    text = (PLANS / "llama_logical.yaml").read_text()
    tp = _specs(shardplan.parse_plan(text), model)
    assert tp["layers/0/attn/wq/kernel"] == (None, ("model",)) and tp["lm_head/kernel"] == (None, ("model",))
    fsdp = _specs(shardplan.parse_plan(text.replace("  embed: null ", "  embed: data ")), model)
    for path in ("layers/0/attn/wq/kernel", "layers/0/mlp/up/kernel", "lm_head/kernel"):
        assert fsdp[path] == (("data",), ("model",))                            # (embed, out)
    assert fsdp["layers/0/attn/wo/kernel"] == (("model",), ("data",))          # (heads, embed)


def test_logical_plan_computes_like_one_device():
    from minigpt_model.llama import Llama
    plan = shardplan.load_plan(PLANS / "llama_logical.yaml")
    tokens = np.random.default_rng(0).integers(0, 128, size=(8, 16), dtype=np.int32)
    config = plan.model.config
    model = shardplan.apply_plan(plan, Llama(**config, rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))
    np.testing.assert_allclose(model(tokens), Llama(**config, rngs=nnx.Rngs(0))(tokens), atol=1e-5)


def test_logical_name_that_is_a_mesh_axis_is_refused(write_plan):
    with pytest.raises(shardplan.PlanError) as error:
        shardplan.load_plan(write_plan("version: 1\nmesh: {axes: {data: 8}}\nlogical_axes: {data: data}\n"
                                       "params: [{match: '.*', spec: []}]\n"))
    (found,) = error.value.diagnostics
    assert found.code == "invalid-value" and "logical axis 'data' is also a mesh axis" in found.message


def test_explain_shows_the_logical_resolution(capsys):
    from shardplan.cli import main
    assert main(["explain", "plans/llama_logical.yaml", "layers/0/attn/wq/kernel"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "spec P(None, 'model') from rule #1" in out
    assert "written ['embed', 'heads'] in logical names; logical_axes maps embed: null, heads: model" in out


# ------------------------------------------------------------------------------ rule formats of other tools

EASYLM = '''
import os
from jax.sharding import PartitionSpec as PS
os.makedirs("CONVERT_RAN")          # reading a rule file must never run it

def get_partition_rules():
    return (
        ("mha/(query|key|value)/kernel", PS(None, "mp")),
        ("mha/out/kernel", PS("mp")),
        ("linear1/kernel", PS(None, "mp")),
        ("linear2/kernel", PS("mp", None)),
        ("token_emb/embedding", PS(("mp", "dp"), None)),
        ("output_layer/kernel", PS(None, "mp")),
        (".*", PS()),
    )
'''


def _minigpt_paths():
    import minigpt_model
    from shardplan.checks.paths import param_infos
    model = nnx.eval_shape(lambda: minigpt_model.MiniGPT(vocab_size=512, num_transformer_blocks=2, rngs=nnx.Rngs(0)))
    return model, [p.path for p in param_infos(model)]


def _searched_specs(rules, paths):
    """What EasyLM does: the first rule whose regex re.search-es the path."""
    import re
    from shardplan.plan.schema import normalize_spec
    def trimmed(spec):          # trailing unsplit dims are not written out in a layout
        spec = normalize_spec(spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return spec
    return {path: trimmed(next(spec for pattern, spec in rules if re.search(pattern, path))) for path in paths}


def test_easylm_rules_convert_to_a_plan_with_the_same_specs(tmp_path, monkeypatch, capsys):
    from shardplan.cli import main
    from shardplan.plan.convert import export_rules, read_rules
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rules.py").write_text(EASYLM)
    assert main(["convert", "rules.py", "--mesh", "dp=4,mp=2", "--input-spec", "dp", "-o", "plan.yaml"]) == 0
    capsys.readouterr()
    assert not (tmp_path / "CONVERT_RAN").exists()
    text = (tmp_path / "plan.yaml").read_text()
    assert "# was 'mha/out/kernel'" in text and "re.search" in text
    plan = shardplan.load_plan(tmp_path / "plan.yaml")
    model, paths = _minigpt_paths()
    rules = read_rules(EASYLM, "python")
    assert _specs(plan, model) == _searched_specs(rules, paths)
    # and back: the plan's rules for re.search code give the same specs again
    exported = read_rules(export_rules(plan), "python")
    assert _searched_specs(exported, paths) == _searched_specs(rules, paths)
    assert main(["export", "plan.yaml", "--format", "yaml"]) == 0
    assert read_rules(capsys.readouterr().out, "yaml") == [(p, [e if e is None or isinstance(e, str) else list(e)
                                                                for e in s]) for p, s in exported]


def test_maxtext_logical_rules_become_logical_axes(tmp_path):
    from shardplan.plan.convert import plan_text, read_logical_rules
    rules = read_logical_rules("logical_axis_rules:\n  - [batch, [data, fsdp]]\n  - [embed, fsdp]\n"
                               "  - [mlp, tensor]\n  - [mlp, model]\n  - [heads, [tensor, sequence]]\n  - [norm, null]\n")
    text = plan_text([], {"data": 4, "model": 2}, source="maxtext.yml", input_spec=["batch", None], logical=rules,
                     logical_source="maxtext.yml")
    plan = shardplan.parse_plan(text)
    assert plan.logical_axes == {"batch": "data", "embed": None, "mlp": "model", "heads": None, "norm": None}
    assert plan.inputs["tokens"] == ["data", None]
    assert "was [data, fsdp]" in text


def test_convert_refuses_what_it_cannot_read(tmp_path, capsys):
    from shardplan.cli import main
    (tmp_path / "bad.py").write_text("rules = [('a', PS(some_variable))]\n")
    assert main(["convert", str(tmp_path / "bad.py"), "--mesh", "dp=8", "-o", str(tmp_path / "p.yaml")]) == 2
    assert "PartitionSpec entry must be None, an axis name or a tuple" in capsys.readouterr().err
    assert main(["convert", "--mesh", "dp=8", "-o", str(tmp_path / "p.yaml")]) == 2
    assert main(["convert", str(tmp_path / "bad.py"), "--mesh", "dp", "-o", str(tmp_path / "p.yaml")]) == 2


# ------------------------------------------------------------------------------ the model's own annotations

class _Annotated(nnx.Module):
    def __init__(self, *, rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.up = nnx.Linear(16, 32, kernel_init=kernel, rngs=rngs)
        self.down = nnx.Linear(32, 16, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model",)),
                               rngs=rngs)

    def __call__(self, x):
        return self.down(self.up(x))


def _annotated_model(plan):
    import jax
    with jax.set_mesh(shardplan.make_mesh(plan)):      # Flax places annotated parameters as they are built
        return _Annotated(rngs=nnx.Rngs(0))


def test_plan_that_overrides_annotations_warns_with_both_specs(write_plan):
    plan = shardplan.load_plan(write_plan("version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {x: [data]}\n"
                                          "params:\n  - {match: '.*', spec: replicated}\n"))
    report = shardplan.check(plan, _annotated_model(plan))
    (found,) = [d for d in report.diagnostics if d.code == "annotation-overridden"]
    assert found.severity == "warning" and report.ok
    assert "gives down/kernel (and 1 more) the spec replicated, but the model annotates it P('model')" in found.message
    assert "spec: annotated" in found.hint


def test_annotated_spec_takes_the_models_own(write_plan):
    plan = shardplan.load_plan(write_plan("version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {x: [data]}\n"
                                          "params:\n  - {match: '.*kernel', spec: annotated}\n"
                                          "  - {match: '.*', spec: replicated}\n"))
    model = _annotated_model(plan)
    assert _specs(plan, model)["up/kernel"] == (None, ("model",))
    assert _specs(plan, model)["down/kernel"] == (("model",),)
    placed = shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))
    assert placed.up.kernel.get_value().sharding.spec == jax_spec(None, "model")


def jax_spec(*entries):
    from jax.sharding import PartitionSpec
    return PartitionSpec(*entries)
