"""Layout arithmetic, checked by hand and against JAX's own view of the same shardings."""

import jax
import pytest
from jax.sharding import NamedSharding

import shardplan
from shardplan.run.specs import partition_spec
from shardplan.core.layout import device_coords, index_ranges, shard_shape, zero1_spec
from shardplan.plan.schema import format_spec, normalize_spec

SIZES = {"data": 4, "model": 2}


def test_normalize_spec_forms():
    assert normalize_spec([None, "_", "model", ["data", "model"]]) == (None, None, ("model",), ("data", "model"))
    assert normalize_spec("replicated") == ()
    assert format_spec(((("data", "model")), None)) == "P(('data', 'model'), None)"
    assert format_spec((None, None)) == "replicated"


@pytest.mark.parametrize(
    "shape, spec, expected",
    [
        ((256, 1024), (None, ("model",)), (256, 512)),
        ((8, 6), (("data", "model"),), (1, 6)),
        ((16,), (), (16,)),
        ((4, 8, 8), (("model",), None, ("data",)), (2, 8, 2)),
    ],
)
def test_shard_shape(shape, spec, expected):
    assert shard_shape(shape, spec, SIZES) == expected


def test_device_coords_row_major():
    assert device_coords(SIZES, 0) == {"data": 0, "model": 0}
    assert device_coords(SIZES, 5) == {"data": 2, "model": 1}


@pytest.mark.parametrize(
    "spec", [(), (("data",),), (None, ("model",)), (("data", "model"),), (("model", "data"),), (("model",), ("data",))]
)
def test_index_ranges_match_jax(spec):
    """Our per-device ranges equal what JAX places, device by device."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shape = (16, 8)
    jax_map = NamedSharding(mesh, partition_spec(spec)).devices_indices_map(shape)
    for position, device in enumerate(mesh.devices.flat):
        ours = index_ranges(shape, spec, SIZES, device_coords(SIZES, position))
        theirs = tuple((s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(jax_map[device]))
        assert ours == theirs, (spec, device)


def test_zero1_spec_adds_data_axis():
    assert zero1_spec((64, 32), (None, ("model",)), SIZES, ("data",)) == (("data",), ("model",))
    assert zero1_spec((6, 32), (None, ("model",)), SIZES, ("data",)) == (None, ("model", "data"))
    assert zero1_spec((64, 32), (("data",),), SIZES, ("data",)) == (("data",),)  # already data-sharded
    assert zero1_spec((3,), (), SIZES, ("data",)) == ()  # nothing divides


def test_check_layout_of_dp_tp_on_abstract_minigpt():
    """Layout from `check` on an abstract model: shard shapes and bytes per device."""
    from flax import nnx
    import minigpt_model

    plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
    model = nnx.eval_shape(lambda: minigpt_model.MiniGPT(vocab_size=50304, rngs=nnx.Rngs(0)))
    report = shardplan.check(plan, model)
    assert report.ok, [d.format() for d in report.diagnostics]
    kernel = report.layout_of("output_layer/kernel")
    assert kernel.shard_shape == (256, 25152)
    assert kernel.bytes_per_device == 256 * 25152 * 4
    assert report.layout_of("transformer_blocks/3/mha/out/kernel").shard_shape == (4, 32, 256)
    assert report.layout_of("transformer_blocks/0/layer_norm1/scale").spec == ()
    totals = {d.param_bytes for d in report.devices}
    assert totals == {sum(p.bytes_per_device for p in report.params)}
    assert report.devices[0].opt_bytes == 2 * report.devices[0].param_bytes


def test_host_axes_cross_hosts_and_others_stay_inside():
    from shardplan.core.mesh import host_major_positions

    positions = host_major_positions({"model": 2, "data": 4}, {"data": 2})
    assert positions.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    host = positions // 4
    assert (host[0] == host[1]).all()  # a model pair never crosses hosts
    assert host[0].tolist() == [0, 0, 1, 1]  # the data axis does


def test_make_mesh_with_hosts_and_inspect_shows_them(write_plan, capsys):
    from shardplan.cli import main

    path = write_plan(
        "version: 1\nmesh:\n  axes: {model: 2, data: 4}\n  hosts: {data: 2}\n"
        "inputs: {tokens: [data, null]}\nparams: [{match: '.*', spec: replicated}]\n"
    )
    mesh = shardplan.make_mesh(shardplan.load_plan(path))
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert main(["inspect", str(path), "--model", "minigpt_model:MiniGPT", "--config", "vocab_size=512"]) == 0
    out = capsys.readouterr().out
    assert "2 hosts x 4 devices; across hosts: data (2 hosts); within: model" in out
    assert "host 0: devices 0-3 (4); host 1: devices 4-7 (4)" in out
