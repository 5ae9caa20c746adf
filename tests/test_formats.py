"""Plans in the terms users bring: logical axes, and the rule formats of other tools."""

import json

import numpy as np
import pytest
from flax import nnx

import shardplan
from shardplan.core.paths import ParamInfo
from shardplan.review.report import check_params

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
        assert fsdp[path] == (("data",), ("model",))  # (embed, out)
    assert fsdp["layers/0/attn/wo/kernel"] == (("model",), ("data",))  # (heads, embed)


def test_logical_plan_computes_like_one_device():
    from minigpt_model.llama import Llama

    plan = shardplan.load_plan(PLANS / "llama_logical.yaml")
    tokens = np.random.default_rng(0).integers(0, 128, size=(8, 16), dtype=np.int32)
    config = plan.model.config
    model = shardplan.apply_plan(plan, Llama(**config, rngs=nnx.Rngs(0)), shardplan.make_mesh(plan))
    np.testing.assert_allclose(model(tokens), Llama(**config, rngs=nnx.Rngs(0))(tokens), atol=1e-5)


def test_logical_name_that_is_a_mesh_axis_is_refused(write_plan):
    with pytest.raises(shardplan.PlanError) as error:
        shardplan.load_plan(
            write_plan(
                "version: 1\nmesh: {axes: {data: 8}}\nlogical_axes: {data: data}\nparams: [{match: '.*', spec: []}]\n"
            )
        )
    (found,) = error.value.diagnostics
    assert found.code == "invalid-value" and "logical axis 'data' is also a mesh axis" in found.message


def test_explain_shows_the_logical_resolution(capsys):
    from shardplan.cli import main

    assert main(["explain", "plans/llama_logical.yaml", "layers/0/attn/wq/kernel"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "spec P(None, 'model') from rule #1" in out
    assert "written ['embed', 'heads'] in logical names; logical_axes maps embed: null, heads: model" in out


# ------------------------------------------------------------------------------ rule formats of other tools

EASYLM = """
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
"""


def _minigpt_paths():
    import minigpt_model
    from shardplan.core.paths import param_infos

    model = nnx.eval_shape(lambda: minigpt_model.MiniGPT(vocab_size=512, num_transformer_blocks=2, rngs=nnx.Rngs(0)))
    return model, [p.path for p in param_infos(model)]


def _searched_specs(rules, paths):
    """What EasyLM does: the first rule whose regex re.search-es the path."""
    import re
    from shardplan.plan.schema import normalize_spec

    def trimmed(spec):  # trailing unsplit dims are not written out in a layout
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
    assert read_rules(capsys.readouterr().out, "yaml") == [
        (p, [e if e is None or isinstance(e, str) else list(e) for e in s]) for p, s in exported
    ]


# Shaped like MaxText's base.yml (written for these tests): names with several rules that fall back per
# array, mesh axes MaxText lists but most runs leave at size 1, and names with no rule at all.
MAXTEXT_RULES = """logical_axis_rules: [
  ['activation_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
  ['activation_embed', 'tensor'],
  ['mlp', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']],
  ['vocab', ['tensor', 'tensor_transpose', 'tensor_sequence', 'autoregressive']],
  ['heads', ['tensor', 'tensor_transpose', 'tensor_sequence', 'autoregressive']],
  ['q_heads', ['tensor', 'tensor_transpose', 'tensor_sequence', 'autoregressive']],
  ['kv_heads', ['tensor', 'tensor_transpose', 'tensor_sequence', 'autoregressive']],
  ['embed', ['fsdp', 'fsdp_transpose', 'sequence', 'tensor_transpose', 'expert']],
  ['embed', ['fsdp', 'sequence', 'tensor_transpose', 'expert']],
  ['embed', ['fsdp', 'fsdp_transpose', 'sequence', 'expert']],
  ['embed', ['fsdp', 'sequence', 'expert']],
  ['embed_no_exp', ['fsdp', 'fsdp_transpose', 'sequence', 'tensor_transpose']],
  ['norm', ['tensor', 'tensor_transpose', 'tensor_sequence']],
  ['layers', 'stage'],
  ['kv', []],
  ['kv_head_dim', []],
  ['exp', 'expert'],
  ['diloco', 'diloco'],
]
"""
# The logical axes of parameters as a MaxText decoder annotates them (and one name no rule has).
MAXTEXT_PARAMS = [
    ["vocab", "embed"],
    ["embed", "q_heads", "kv"],
    ["embed", "kv_heads", "kv_head_dim"],
    ["heads", "kv", "embed"],
    ["embed", "mlp"],
    ["mlp", "embed"],
    ["norm"],
    ["embed", "vocab"],
    ["exp", "embed_no_exp", "mlp"],
    ["exp", "mlp", "embed_no_exp"],
    ["layers", "embed", "mlp"],
    ["embed", "num_activations", "mlp"],
    ["diloco", "embed"],
]
MAXTEXT_MESHES = [
    {"fsdp": 8},
    {"data": 2, "fsdp": 4},
    {"fsdp": 4, "tensor": 2},
    {"data": 2, "tensor": 4},
    {"fsdp": 2, "fsdp_transpose": 2, "tensor": 2},
    {"expert": 4, "fsdp": 2},
    {"stage": 2, "fsdp": 2, "tensor": 2},
    {"sequence": 2, "fsdp": 2, "tensor_transpose": 2},
]


def _physical(entries, sizes) -> list:
    """A spec with axes of size 1 dropped, as MaxText runs it."""
    out = []
    for entry in entries:
        axes = [
            a for a in ([] if entry is None else [entry] if isinstance(entry, str) else list(entry)) if sizes[a] > 1
        ]
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return out


@pytest.mark.parametrize("given", MAXTEXT_MESHES)
def test_maxtext_rules_convert_to_what_flax_resolves(given):
    """Every spec of the converted plan equals flax.linen.logical_to_mesh_axes with MaxText's rules."""
    from flax.linen import logical_to_mesh_axes
    from shardplan.plan.convert import plan_text, read_logical_rules

    rules = read_logical_rules(MAXTEXT_RULES)
    text = plan_text([], given, source="base.yml", logical=rules, logical_source="base.yml")
    params = "".join(f"  - {{match: 'p{k}', spec: {json.dumps(names)}}}\n" for k, names in enumerate(MAXTEXT_PARAMS))
    plan = shardplan.parse_plan(text.replace("params:\n", "params:\n" + params, 1))
    sizes = plan.mesh.axes
    named = {a for _, axes in rules for a in ([axes] if isinstance(axes, str) else axes or [])}
    assert set(sizes) == named | set(given) and all(sizes[a] == 1 for a in sizes if a not in given)
    flax_rules = [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules]
    for k, names in enumerate(MAXTEXT_PARAMS):
        want = _physical(list(logical_to_mesh_axes(names, flax_rules)), sizes)
        got = _physical(plan.params[k].spec, sizes)
        assert got == want, (names, got, want)
    infos = [ParamInfo(f"p{k}", (16,) * len(n), np.dtype("float32")) for k, n in enumerate(MAXTEXT_PARAMS)]
    report = check_params(plan, infos, list(range(8)))
    assert not report.errors, [d.format() for d in report.errors]


def test_explain_names_the_logical_rule_each_dim_took(tmp_path, capsys):
    from shardplan.cli import main
    from shardplan.plan.convert import plan_text, read_logical_rules

    text = plan_text(
        [],
        {"fsdp": 2, "fsdp_transpose": 2, "tensor": 2},
        source="base.yml",
        logical=read_logical_rules(MAXTEXT_RULES),
        logical_source="base.yml",
    )
    plan = tmp_path / "plan.yaml"
    plan.write_text(text.replace("params:\n", "params:\n  - {match: 'mlp/wi/kernel', spec: [embed, mlp]}\n", 1))
    assert main(["explain", str(plan), "mlp/wi/kernel"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "embed: logical rule #9" in out and "mlp: logical rule #3" in out, out  # embed fell back twice


# Shaped like an EasyDeL config module (written for these tests): one rule list per data-parallel style,
# chosen by an argument with a default, and a second config class with lists of its own.
EASYDEL = """
from jax.sharding import PartitionSpec


class LlamaConfig:
    def get_partition_rules(self, fully_sharded_data_parallel: bool = True):
        return (
            ("token_emb/embedding", PartitionSpec("tp", ("fsdp", "sp"))),
            ("mha/(query|key|value)/kernel", PartitionSpec(("fsdp", "sp"), "tp")),
            ("mha/out/kernel", PartitionSpec("tp", ("fsdp", "sp"))),
            ("linear1/kernel", PartitionSpec(("fsdp", "sp"), "tp")),
            ("linear2/kernel", PartitionSpec("tp", ("fsdp", "sp"))),
            ("output_layer/kernel", PartitionSpec(("fsdp", "sp"), "tp")),
            (".*", PartitionSpec(None)),
        ) if not fully_sharded_data_parallel else (
            ("token_emb/embedding", PartitionSpec(("fsdp", "sp"))),
            ("(?i)MHA/(query|key|value)/kernel", PartitionSpec(("fsdp", "sp"))),
            ("mha/out/kernel", PartitionSpec(("fsdp", "sp"))),
            ("linear1/kernel", PartitionSpec(("fsdp", "sp"))),
            ("linear2/kernel", PartitionSpec(("fsdp", "sp"))),
            ("output_layer/kernel", PartitionSpec(("fsdp", "sp"))),
            (".*", PartitionSpec(("fsdp", "sp"))),
        )


class VisionLlamaConfig(LlamaConfig):
    def get_partition_rules(self, fully_sharded_data_parallel: bool = True):
        if not fully_sharded_data_parallel:
            return (("vision/.*", PartitionSpec("tp")), (".*", PartitionSpec(None)))
        else:
            return (("vision/.*", PartitionSpec(("fsdp", "sp"))), (".*", PartitionSpec(("fsdp", "sp"))))
"""


def test_easydel_files_with_several_lists_are_chosen_explicitly_never_silently(tmp_path, capsys):
    from shardplan.cli import main
    from shardplan.plan.convert import pick, rule_lists

    rules = tmp_path / "llama_config.py"
    rules.write_text(EASYDEL)
    out = tmp_path / "plan.yaml"
    base = ["convert", str(rules), "--mesh", "fsdp=4,sp=1,tp=2", "-o", str(out)]
    assert main(base) == 2 and not out.exists()  # two classes: which one?
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "holds 2 rule lists" in err and "LlamaConfig.get_partition_rules when fully_sharded_data_parallel=True" in err
    )
    assert "VisionLlamaConfig" in err and "--list NAME" in err
    assert main([*base, "--list", "LlamaConfig", "--flag", "fsdp=false"]) == 2  # a flag that can do nothing
    assert "--flag fsdp: no rule list depends on it" in " ".join(capsys.readouterr().err.split())
    lists = rule_lists(EASYDEL, "python", "llama_config.py")
    model, paths = _minigpt_paths()
    for flags, wanted in (([], True), (["--flag", "fully_sharded_data_parallel=false"], False)):
        assert main([*base, "--list", "LlamaConfig", *flags]) == 0
        said = " ".join(capsys.readouterr().out.split())
        assert "7 rules from LlamaConfig.get_partition_rules" in said, said
        assert ("(its default)" in said) == (not flags)
        expected = next(
            rl
            for rl in lists
            if rl.where == "LlamaConfig.get_partition_rules" and rl.when == (("fully_sharded_data_parallel", wanted),)
        )
        chosen, _ = pick(lists, "f", choose="LlamaConfig", flags={"fully_sharded_data_parallel": wanted})
        assert chosen == expected
        assert _specs(shardplan.load_plan(out), model) == _searched_specs(expected.rules, paths)


def test_converted_patterns_keep_inline_flags_and_a_bad_one_names_the_input_line(tmp_path, capsys):
    from shardplan.cli import main

    rules = tmp_path / "rules.py"
    rules.write_text(
        "from jax.sharding import PartitionSpec as PS\n\nRULES = (\n    ('(?i)OUTPUT_layer/kernel', PS(None, 'mp')),\n"
        "    ('mha/(query)\\\\1', PS()),\n    ('.*', PS()),\n)\n"
    )
    out = tmp_path / "plan.yaml"
    assert main(["convert", str(rules), "--mesh", "dp=4,mp=2", "-o", str(out)]) == 1 and not out.exists()
    err = " ".join(capsys.readouterr().err.split())
    # (a path longer than the console's line is folded at a '/', wherever pytest puts its temporary files)
    assert f"{rules}:5" in err.replace("/ ", "/") and "regex-too-slow" in err and "nothing was written" in err, err
    rules.write_text(rules.read_text().replace("    ('mha/(query)\\\\1', PS()),\n", ""))
    assert main(["convert", str(rules), "--mesh", "dp=4,mp=2", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    plan = shardplan.load_plan(out)
    model, paths = _minigpt_paths()
    assert _specs(plan, model)["output_layer/kernel"] == ((None, ("mp",)))


def test_convert_refuses_what_it_cannot_read(tmp_path, capsys):
    from shardplan.cli import main

    (tmp_path / "bad.py").write_text("rules = [('a', PS(some_variable))]\n")
    assert main(["convert", str(tmp_path / "bad.py"), "--mesh", "dp=8", "-o", str(tmp_path / "p.yaml")]) == 2
    assert "PartitionSpec entry must be None, an axis name or a tuple" in " ".join(capsys.readouterr().err.split())
    assert main(["convert", "--mesh", "dp=8", "-o", str(tmp_path / "p.yaml")]) == 2
    assert main(["convert", str(tmp_path / "bad.py"), "--mesh", "dp", "-o", str(tmp_path / "p.yaml")]) == 2
    capsys.readouterr()
    # entries of the wrong type, as the mutation fuzzer wrote them (each was an internal error)
    (tmp_path / "rules.yaml").write_text("- [embedding, [model, {a: 1}]]\n")
    assert main(["convert", str(tmp_path / "rules.yaml"), "--mesh", "model=8", "-o", str(tmp_path / "p.yaml")]) == 2
    assert "item 1 is" in capsys.readouterr().err
    for axes in ("1.0e+308", "true", "[data, 3]", "{a: 1}"):
        (tmp_path / "logical.yaml").write_text(f"logical_axis_rules:\n- [embed, fsdp]\n- [heads, {axes}]\n")
        assert (
            main(
                [
                    "convert",
                    "--logical-rules",
                    str(tmp_path / "logical.yaml"),
                    "--mesh",
                    "fsdp=8",
                    "-o",
                    str(tmp_path / "p.yaml"),
                ]
            )
            == 2
        )
        assert "expected a list of [logical name, mesh axes] pairs" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the model's own annotations


class _Annotated(nnx.Module):
    def __init__(self, *, rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.up = nnx.Linear(16, 32, kernel_init=kernel, rngs=rngs)
        self.down = nnx.Linear(
            32, 16, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model",)), rngs=rngs
        )

    def __call__(self, x):
        return self.down(self.up(x))


def _annotated_model(plan):
    import jax

    with jax.set_mesh(shardplan.make_mesh(plan)):  # Flax places annotated parameters as they are built
        return _Annotated(rngs=nnx.Rngs(0))


def test_plan_that_overrides_annotations_warns_with_both_specs(write_plan):
    plan = shardplan.load_plan(
        write_plan(
            "version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {x: [data]}\n"
            "params:\n  - {match: '.*', spec: replicated}\n"
        )
    )
    report = shardplan.check(plan, _annotated_model(plan))
    (found,) = [d for d in report.diagnostics if d.code == "annotation-overridden"]
    assert found.severity == "warning" and report.ok
    assert "gives down/kernel (and 1 more) the spec replicated, but the model annotates it P('model')" in found.message
    assert "spec: annotated" in found.hint


def test_annotated_spec_takes_the_models_own(write_plan):
    plan = shardplan.load_plan(
        write_plan(
            "version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {x: [data]}\n"
            "params:\n  - {match: '.*kernel', spec: annotated}\n"
            "  - {match: '.*', spec: replicated}\n"
        )
    )
    model = _annotated_model(plan)
    assert _specs(plan, model)["up/kernel"] == (None, ("model",))
    assert _specs(plan, model)["down/kernel"] == (("model",),)
    placed = shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))
    assert placed.up.kernel.get_value().sharding.spec == jax_spec(None, "model")


def jax_spec(*entries):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*entries)


class _ArticleAnnotated(nnx.Module):
    """Annotated as the seed article's tutorial does: a `NamedSharding` on its own mesh in each kernel's
    metadata (`nnx.with_partitioning(init, NamedSharding(mesh, P(...)))`)."""

    def __init__(self, mesh, *, rngs):
        from jax.sharding import NamedSharding, PartitionSpec as P

        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            16, 32, kernel_init=nnx.with_partitioning(init, NamedSharding(mesh, P(None, "model"))), rngs=rngs
        )
        self.down = nnx.Linear(
            32, 16, kernel_init=nnx.with_partitioning(init, NamedSharding(mesh, P("model", None))), rngs=rngs
        )

    def __call__(self, x):
        return self.down(self.up(x))


@pytest.mark.parametrize("abstract", [False, True])
def test_a_model_annotated_the_articles_way_is_read(write_plan, abstract):
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    make = lambda: _ArticleAnnotated(mesh, rngs=nnx.Rngs(0))  # noqa: E731
    model = nnx.eval_shape(make) if abstract else make()
    own = shardplan.load_plan(
        write_plan(
            "version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {x: [data]}\n"
            "params:\n  - {match: '.*', spec: replicated}\n"
        )
    )
    report = shardplan.check(own, model)
    assert report.ok
    (found,) = [d for d in report.diagnostics if d.code == "annotation-overridden"]
    assert "P('model', None)" in found.message or "P('model')" in found.message, found.message
    annotated = shardplan.load_plan(
        write_plan(
            "version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {x: [data]}\n"
            "params:\n  - {match: '.*kernel', spec: annotated}\n"
            "  - {match: '.*', spec: replicated}\n"
        )
    )
    assert shardplan.check(annotated, model).ok
    assert _specs(annotated, model)["up/kernel"] == (None, ("model",))
    if not abstract:
        placed = shardplan.apply_plan(annotated, model, shardplan.make_mesh(annotated))
        assert placed.down.kernel.get_value().sharding.spec == jax_spec("model")


def test_logical_rules_keep_entries_that_list_mesh_axes_as_they_are(write_plan):
    """A spec entry listing several mesh axes passes once, in inputs and parameters alike (it was doubled:
    `[fsdp, fsdp_transpose]` became four axes and a false `input-axis-repeated`)."""
    plan = shardplan.load_plan(
        write_plan(
            "version: 1\nmesh: {axes: {fsdp: 4, fsdp_transpose: 2}}\n"
            "inputs: {x: {spec: [[fsdp, fsdp_transpose], null], shape: [8, 16]}}\n"
            "logical_rules:\n  - [embed, fsdp]\n  - [mlp, fsdp_transpose]\n"
            "params:\n  - {match: 'kernel', spec: [[fsdp, fsdp_transpose], null]}\n"
            "  - {match: '.*', spec: replicated}\n"
        )
    )
    report = shardplan.check(plan, nnx.eval_shape(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0))))
    assert not report.errors, [d.format() for d in report.errors]
    assert {p.path: p.spec for p in report.params}["kernel"] == (("fsdp", "fsdp_transpose"),)


def test_a_misspelt_logical_name_is_reported_as_one_with_a_suggestion(write_plan):
    plan = shardplan.load_plan(
        write_plan(
            "version: 1\nmesh: {axes: {data: 4, model: 2}}\ninputs: {x: [data]}\n"
            "logical_axes: {haeds: model, embed: null}\n"
            "params:\n  - {match: 'kernel', spec: [embed, heads]}\n"
            "  - {match: '.*', spec: replicated}\n"
        )
    )
    report = shardplan.check(plan, nnx.eval_shape(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0))))
    (found,) = report.errors
    assert (
        found.code == "unknown-axis"
        and "neither a mesh axis (data, model) nor a logical name (haeds, embed)" in found.message
        and found.hint == "did you mean 'haeds' (a logical name)?"
    ), found.format()


@pytest.mark.parametrize(
    "value",
    [
        {"axes": {"data": 4, "model": 2}, "spec": [None, ["data", "fsdp"]]},
        {"factory": "minigpt_model:MiniGPT", "config": {"dropout_rate": 0.1, "tie": True, "name": "a: b, c"}},
        ["null", "yes", "NO", "on", "~", "1e3", "0x10", "-", "it's", "[x]", "{y}", "#z", "*a", "&b", "!c", "%d"],
        {"transformer_blocks/\\d+/mha/(query|key)/kernel": ["model"], "on": 1, "": None},
        [1, 2.5, -3, 1e-12, 3e20, -2.5e-7, float("inf"), False, None, ""],
    ],
)
def test_written_values_load_back_as_they_were(value):
    """`auto` and `convert` write plans with `plan.writer`: whatever they write, YAML reads back the same."""
    import yaml

    from shardplan.plan.writer import flow, quoted

    assert yaml.safe_load(f"value: {flow(value)}") == {"value": value}
    for text in ("it's", "a: b", "transformer_blocks/\\d+/mha/(query|key)/kernel"):
        assert yaml.safe_load(f"- match: {quoted(text)}") == [{"match": text}]
