"""shardplan: declarative sharding plans for JAX/Flax NNX models.

    plan = shardplan.load_plan("plans/minigpt_dp_tp.yaml")
    mesh = shardplan.make_mesh(plan)
    report = shardplan.check(plan, model, mesh)
    model = shardplan.apply_plan(plan, model, mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(3e-4), mesh)
    batch = shardplan.shard_inputs(plan, {"tokens": tokens}, mesh)
"""

from shardplan.checks.mesh import make_mesh
from shardplan.checks.report import Report, check
from shardplan.plan.diagnostics import CODES, Diagnostic, PlanError
from shardplan.plan.loader import load_plan, parse_plan
from shardplan.plan.schema import Plan

__all__ = ["CODES", "Diagnostic", "Plan", "PlanError", "Report", "apply_plan", "check", "constrain", "load_plan",
           "make_mesh", "parse_plan", "shard_inputs", "shard_local_inputs", "shard_optimizer"]


def __getattr__(name: str):
    # The runtime half imports JAX, Flax and optax; loading it lazily keeps `--help`, `schema`,
    # `explain` and plan-only `validate` free of them (tests/test_cli.py checks) and lets the CLI
    # set the device count before JAX starts.
    if name in ("apply_plan", "shard_optimizer", "shard_inputs", "shard_local_inputs", "constrain", "partition_spec"):
        from shardplan.run import apply
        return getattr(apply, name)
    raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
