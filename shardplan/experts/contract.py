"""Whether the plan's MoE blocks can run expert-parallel, found by tracing one example call abstractly
with the blocks made expert-parallel (nothing is compiled or run)."""

from __future__ import annotations

from shardplan.experts.check import expected_drop_share
from shardplan.plan.diagnostics import Diagnostic


def model_checks(subject, found: list[Diagnostic]) -> list[Diagnostic]:
    """Whether the MoE blocks can run expert-parallel, on the example call or, where the plan's inputs
    give no shapes, on a made-up call of the blocks alone (`subject`: a `ModelUnderPlan`)."""
    report = subject.report
    if not report.experts or subject.plan_errors:
        return []
    call = subject.call if subject.call is not None else blocks_call(subject.model, report)
    if call is None:
        return []
    return check_expert_calls(subject.plan, subject.model, report, call, subject.mesh, made_up=subject.call is None)


def check_expert_calls(plan, model, report, call, mesh, *, made_up: bool = False) -> list[Diagnostic]:
    """`made_up`: `call` is `blocks_call`'s (the plan's inputs give no shapes), so its token count is not
    the user's and the capacity warning says so."""
    import jax
    from flax import nnx

    from shardplan.core.changes import undo
    from shardplan.core.paths import module_paths
    from shardplan.experts.block import FALLBACKS, TRACED, install
    from shardplan.experts.interpret import ContractError

    paths = {id(m): p for p, m in module_paths(model)}
    changed = install(plan, model, mesh, report.experts)
    # the traced call runs on a copy of the model: its blocks are known by their class
    names = {
        type(c.module): ", ".join(paths[id(o.module)] for o in changed if type(o.module) is type(c.module))
        for c in changed
    }
    seen: list = []
    fallbacks: list = []
    token, fallback_token = TRACED.set(seen), FALLBACKS.set(fallbacks)
    line, col = plan.locate("experts", "blocks")
    try:
        graphdef, state = nnx.split(model)
        jax.eval_shape(lambda s: call(nnx.merge(graphdef, s)), state)
    except ContractError as exc:
        block = names.get(exc.block, "?")
        return [
            Diagnostic(
                "experts-contract",
                "error",
                f"block {block}: {exc}" + (f" (at {exc.where})" if exc.where else ""),
                file=plan.file,
                line=line,
                column=col,
                path=block.split(", ")[0],
                hint="see docs/experts.md for what a MoE block may look like",
            )
        ]
    except Exception as exc:
        failed = exc
    else:
        failed = None
    finally:
        TRACED.reset(token)
        FALLBACKS.reset(fallback_token)
        undo(changed)
    if failed is not None:
        try:  # the example call's own failure is reported by the other model checks
            graphdef, state = nnx.split(model)
            jax.eval_shape(lambda s: call(nnx.merge(graphdef, s)), state)
        except Exception:
            return []
        blocks = ", ".join(sorted({paths[id(c.module)] for c in changed}))
        return [
            Diagnostic(
                "experts-contract",
                "error",
                f"the model's example call fails once its MoE blocks "
                f"({blocks}) are made expert-parallel, and runs without: {type(failed).__name__}: "
                f"{str(failed).splitlines()[0][:300] if str(failed) else ''}",
                file=plan.file,
                line=line,
                column=col,
                path=blocks.split(", ")[0],
                hint="a bug in shardplan; please report it with the block's code",
            )
        ]
    found = []
    for cls, reason, at in sorted({(names.get(c, "?"), r, w or "") for c, r, w in fallbacks}):
        found.append(
            Diagnostic(
                "experts-fallback",
                "warning",
                f"block {cls}: {reason}"
                + (f" (at {at})" if at else "")
                + "; it runs expert-parallel the dense way instead: its tokens gathered over the "
                f"expert axis {plan.experts.axis!r}, every device running its own experts on all "
                "of them, the outputs reduce-scattered back (exact; more bytes and FLOPs than the "
                "sparse path's all-to-all)",
                file=plan.file,
                line=line,
                column=col,
                path=cls.split(", ")[0],
                hint="docs/experts.md says which forms take the sparse path; `python benchmarks/moe.py` measures both",
            )
        )
    if plan.experts.dispatch == "capacity":
        for block, rows, tokens, experts, capacity in sorted({(names.get(b, "?"), *rest) for b, *rest in seen}):
            block = block.split(", ")[0]
            top_k = max(1, rows // max(tokens, 1))
            share = expected_drop_share(tokens, experts, top_k, capacity)
            if share > 0.001:
                found.append(
                    Diagnostic(
                        "experts-capacity-drops",
                        "warning",
                        f"block {block!r}: capacity_factor {plan.experts.capacity_factor} gives "
                        f"{capacity} slots per (device, expert) for {tokens} tokens per device "
                        f"choosing {top_k} of {experts} experts; a uniform router drops about "
                        f"{share:.1%} of routed rows"
                        + (
                            " (on an example batch: the plan's inputs "
                            "give no shapes, and the share depends on the tokens per device)"
                            if made_up
                            else ""
                        ),
                        file=plan.file,
                        line=line,
                        column=col,
                        path=block,
                        hint="raise capacity_factor, or use dispatch: dropless",
                    )
                )
    return found


def blocks_call(model, report):
    """For a plan whose inputs carry no shapes: a call of the MoE blocks alone, each on zeros [rows, 8, D]
    (or [rows * 8, D] where the block takes rows), D the router's other dim and rows the device count
    twice over, so that every block's code is checked all the same. None if the blocks take neither."""
    import math

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from shardplan.core.paths import module_paths

    shapes = {p.path: (p.shape, p.dtype) for p in report.params}
    blocks = []
    for r in report.experts:
        shape, dtype = shapes[r.router]
        blocks.append((r.block, shape[0] if shape[1] == r.count else shape[1], dtype))
    rows = 2 * math.prod(report.axes.values())

    def call_with(shape_of):
        def call(m):
            found = dict(module_paths(m))
            return [found[block](jnp.zeros(shape_of(width), dtype)) for block, width, dtype in blocks]

        return call

    graphdef, state = nnx.split(model)
    for shape_of in (lambda d: (rows, 8, d), lambda d: (rows * 8, d)):
        call = call_with(shape_of)
        try:
            jax.eval_shape(lambda s: call(nnx.merge(graphdef, s)), state)
        except Exception:
            continue
        return call
    return None
