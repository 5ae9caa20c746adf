"""shardplan: declarative sharding plans for JAX/Flax NNX models.

plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
mesh = shardplan.make_mesh(plan)
report = shardplan.check(plan, model, mesh)
model = shardplan.apply_plan(plan, model, mesh)
optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(3e-4), mesh)
batch = shardplan.shard_inputs(plan, {"tokens": tokens}, mesh)
loss = shardplan.model_loss(model, loss_of, targets, tokens)   # any plan; 1F1B computes it in the pipeline
step = shardplan.jit_step(train_step, model, optimizer)        # compiled once; no graph walk per call
"""

from shardplan.core.mesh import make_mesh
from shardplan.review.report import Report
from shardplan.compose.check import check
from shardplan.plan.diagnostics import CODES, Diagnostic, PlanError, PlanWarning
from shardplan.plan.loader import load_plan, parse_plan
from shardplan.plan.schema import Plan

__all__ = [
    "CODES",
    "Diagnostic",
    "Plan",
    "PlanError",
    "PlanWarning",
    "Report",
    "apply_plan",
    "check",
    "constrain",
    "dropped_rows",
    "init",
    "jit_step",
    "load_plan",
    "make_mesh",
    "model_loss",
    "parse_plan",
    "performance_flags",
    "place_variables",
    "plain_tree",
    "restore_checkpoint",
    "set_performance_flags",
    "shard_inputs",
    "shard_local_inputs",
    "shard_optimizer",
    "simulate_cpu_devices",
    "terminal",
    "to_plain",
    "training",
]


def __getattr__(name: str):
    if name in ("terminal", "training"):  # namespaces for a training program and its command line
        import importlib

        return importlib.import_module(f"shardplan.{name}")
    # The runtime half imports JAX, Flax and optax; loading it lazily keeps `--help`, `schema`,
    # `explain` and plan-only `validate` free of them (tests/test_cli.py checks) and lets the CLI
    # set the device count before JAX starts.
    if name in (
        "apply_plan",
        "init",
        "shard_optimizer",
        "place_variables",
        "shard_inputs",
        "shard_local_inputs",
        "constrain",
        "partition_spec",
    ):
        from shardplan.compose import apply

        return getattr(apply, name)
    if name == "simulate_cpu_devices":  # must run before JAX starts: importing it starts nothing
        from shardplan.processes.devices import simulate_cpu_devices

        return simulate_cpu_devices
    if name in ("performance_flags", "set_performance_flags"):  # the same: plain Python
        from shardplan.processes import flags

        return getattr(flags, name)
    if name == "jit_step":
        from shardplan.run.jit_step import jit_step

        return jit_step
    if name == "restore_checkpoint":
        from shardplan.compose.restore import restore_checkpoint

        return restore_checkpoint
    if name == "dropped_rows":
        from shardplan.experts.block import dropped_rows

        return dropped_rows
    if name in ("model_loss", "to_plain", "plain_tree"):
        from shardplan.pipeline import pipelined

        return getattr(pipelined, name)
    raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
