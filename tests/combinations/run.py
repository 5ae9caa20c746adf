"""One case in this process: `check`, then (if valid) two AdamW steps of the sharded model against the
same steps on one device: loss, gradients and parameters.

The reference is the same model under a one-device plan with the case's precision (a bfloat16 plan is
compared with bfloat16 on one device). AdamW's epsilon is large (1e-3) so that an update is a smooth
function of its gradient: with the default, a gradient of 1e-9 whose sign differs by rounding would move
its parameter by twice the learning rate."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import traceback

import numpy as np

from .models import SEQ, VOCAB

STEPS = 2
LEARNING_RATE = 1e-2
# float32: the sharded step sums in another order than one device (observed ~1e-6 of the largest gradient);
# bfloat16 keeps 8 bits, and the order of its sums moves more (docs/step.md: ~5% of the largest gradient).
# A router's top-k in bfloat16 flips between near-tied experts when the sum before it rounds otherwise
# (measured: one token's flip moved an embedding gradient by 80%): routed bfloat16 models are held to the loss.
TOLERANCE = {
    "float32": dict(loss=1e-5, grads=1e-4, params=1e-4),
    "bfloat16": dict(loss=2e-2, grads=0.15, params=None),
    "bfloat16-routed": dict(loss=2e-2, grads=None, params=None),
}


def plan_text(case: dict) -> str:
    import yaml

    header = (
        f"# combination case {case['id']}: {case['kind']} on {case['devices']} devices, {case['rows']} rows"
        + (f"; must be refused with {case['expect']}" if case["expect"] else "")
        + "\n"
        "# repro: python -m tests.combinations --replay THIS_FILE\n"
    )
    return header + yaml.safe_dump(case["plan"], sort_keys=False, default_flow_style=None, width=100)


def _regather_on_cpu() -> None:
    """`--regather` (`REGATHER_ENV` set): FSDP layers gather again for their backward here too, as on
    accelerators (XLA:CPU merges the gathers back, so only the numbers are tested, not the memory)."""
    if os.environ.get(REGATHER_ENV):
        from shardplan.run import step_options

        step_options.keeps_barriers = lambda mesh: True


REGATHER_ENV = "SHARDPLAN_TEST_REGATHER"


def run_case(case: dict) -> dict:
    """{status, codes, detail}: status is passed, refused (a valid draw refused by check: allowed),
    wrong (other numbers), failed (an error after check said valid), not-refused (an invalid plan
    check accepted) or refused-otherwise (an invalid plan refused with other codes)."""
    import shardplan

    _regather_on_cpu()
    text = plan_text(case)
    try:
        plan = shardplan.parse_plan(text)
        mesh = shardplan.make_mesh(plan)
        report = shardplan.check(plan, _model(case), mesh)
        codes = sorted({d.code for d in report.errors})
    except shardplan.PlanError as error:
        report, codes = None, sorted({d.code for d in error.diagnostics if d.severity == "error"})
    warnings = sorted({d.code for d in report.warnings}) if report is not None else []
    if codes:
        expected = case["expect"]
        status = "refused" if expected is None else "passed" if expected in codes else "refused-otherwise"
        return {"status": status, "codes": codes, "warnings": warnings, "detail": ""}
    if case["expect"]:
        return {
            "status": "not-refused",
            "codes": [],
            "warnings": warnings,
            "detail": f"check accepted a plan with {case['expect']}",
        }
    try:
        got = _train(case, plan, mesh)
        want = _reference(
            case["kind"],
            json.dumps(case["config"], sort_keys=True),
            case["rows"],
            json.dumps(case["plan"].get("precision", {}), sort_keys=True),
        )
        precision = _precision(plan)
        problem = _compare(
            got, want, f"{precision}-routed" if precision != "float32" and case["kind"] == "moe" else precision
        )
    except Exception as error:  # an error after check said valid: the case's finding
        return {
            "status": "failed",
            "codes": [],
            "warnings": warnings,
            "detail": _shortened("".join(traceback.format_exception_only(error)).strip()),
        }
    return {"status": "wrong" if problem else "passed", "codes": [], "warnings": warnings, "detail": problem or ""}


def _shortened(text: str, keep: int = 700) -> str:
    return text if len(text) <= 2 * keep else f"{text[:keep]} [...] {text[-keep:]}"


def _precision(plan) -> str:
    return "bfloat16" if "bfloat16" in (plan.precision.compute, plan.precision.params) else "float32"


def _model(case: dict):
    from . import models

    return models.build(case["kind"], **case["config"])


def _batches(rows: int):
    rng = np.random.default_rng(rows)
    tokens = rng.integers(0, VOCAB, size=(STEPS, rows, SEQ + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (rows, SEQ))
    return [(t[:, :-1], positions, t[:, 1:]) for t in tokens]


def _train(case: dict, plan, mesh) -> dict:
    import jax
    import optax

    import shardplan

    model = shardplan.apply_plan(plan, _model(case), mesh)
    optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(LEARNING_RATE, eps=1e-3), mesh)
    # (explicit axes resolve bare specs, a model's or the step options', on the mesh in context)
    within = jax.set_mesh(mesh) if "explicit" in plan.mesh.types.values() else contextlib.nullcontext()
    with within:
        return _steps(case, plan, mesh, model, optimizer)


def _steps(case: dict, plan, mesh, model, optimizer) -> dict:
    import shardplan

    losses, grads = [], []
    for tokens, positions, targets in _batches(case["rows"]):
        batch = shardplan.shard_inputs(plan, {"tokens": tokens, "positions": positions}, mesh)
        targets = shardplan.shard_inputs(plan, {"tokens": targets}, mesh)["tokens"]
        loss, grad = _step(model, optimizer, batch["tokens"], batch["positions"], targets)
        losses.append(float(loss))
        grads.append(_plain(model, grad))
    return {"losses": losses, "grads": grads, "params": _plain(model, _params(model))}


def _params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _plain(model, tree) -> dict:
    """A pure dict of the model's layout (stacked pipeline layers unstacked) as flat numpy leaves."""
    import jax

    import shardplan

    tree = shardplan.plain_tree(model, tree)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf), np.float32) for path, leaf in flat}


@functools.cache
def _step_fn():
    from flax import nnx

    import shardplan
    from shardplan.pipeline.loop import cross_entropy

    @nnx.jit
    def step(model, optimizer, tokens, positions, targets):
        def loss_of(model):
            return shardplan.model_loss(model, cross_entropy, targets, tokens, positions)

        loss, grads = nnx.value_and_grad(loss_of)(model)
        optimizer.update(model, grads)
        return loss, nnx.to_pure_dict(grads)

    return step


def _step(*args):
    return _step_fn()(*args)


@functools.cache
def _reference(kind: str, config: str, rows: int, precision: str) -> dict:
    import jax

    import shardplan

    extra = f"precision: {precision}\n"
    plan = shardplan.parse_plan(
        f"version: 1\nmesh: {{axes: {{one: 1}}}}\ninputs: {{tokens: [null, null], "
        f"positions: [null, null]}}\nparams: [{{match: '.*', spec: []}}]\n{extra}"
    )
    mesh = shardplan.make_mesh(plan, devices=jax.devices()[:1])
    return _train({"kind": kind, "config": json.loads(config), "rows": rows}, plan, mesh)


def _compare(got: dict, want: dict, precision: str) -> str | None:
    tol = TOLERANCE[precision]
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        if not math.isclose(a, b, rel_tol=tol["loss"]) or not math.isfinite(a):
            return f"step {step + 1}: loss {a:.7g}, one device {b:.7g}"
    for step, (a, b) in enumerate(zip(got["grads"], want["grads"]) if tol["grads"] is not None else ()):
        problem = _leaves_differ(a, b, tol["grads"], relative=True)
        if problem:
            return f"step {step + 1} gradient: {problem}"
    if tol["params"] is not None:
        problem = _leaves_differ(got["params"], want["params"], tol["params"], relative=False)
        if problem:
            return f"parameters after {STEPS} steps: {problem}"
    return None


def _leaves_differ(a: dict, b: dict, tol: float, *, relative: bool) -> str | None:
    if a.keys() != b.keys():
        return f"other leaves: {sorted(a.keys() ^ b.keys())[:4]}"
    scale = max((float(np.max(np.abs(v))) for v in b.values() if v.size), default=1.0) if relative else 1.0
    worst, where = 0.0, None
    for key in a:
        diff = float(np.max(np.abs(a[key] - b[key]))) if a[key].size else 0.0
        if not math.isfinite(diff) or diff > worst:
            worst, where = (math.inf if not math.isfinite(diff) else diff), key
    if worst > tol * scale:
        return f"{where} off by {worst:.3g} (largest reference value {scale:.3g}, tolerance {tol * scale:.3g})"
    return None
