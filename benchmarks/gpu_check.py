"""On one GPU: the matmul speeds the cost model assumes, and the plan's precision as it runs.

`--gemms`: bfloat16 matmuls of the shapes a transformer layer multiplies (tokens x width x width, and
the MLP's 4x), each timed as a chain of dependent products inside one compiled program (no Python
dispatch between them). The time model is t = 2MKN / (peak x matmul_efficiency) + matmul_overhead;
both are fitted here by least squares on relative error and printed beside the profile's figures.

`--precision`: MiniGPT (8 blocks, width 1024, vocabulary 32768, 8 x 1024 tokens) one AdamW step on
one device in float32, under `precision: {compute: bfloat16}`, and under the same plan with the
modules left in the dtype they were built with (the behaviour before `shardplan.run.precision`): the
compiled memory (`memory_analysis()`), the measured step time, and the cost model's figures for the
same plan with the `h200` profile.

`--sequences`: the bf16 step at 8,192 tokens as 32 x 256, 8 x 1,024 and 2 x 4,096.

`--parts`: that step taken apart (forward, backward, update, and `nnx.jit`'s own cost).

    python benchmarks/gpu_check.py --gemms --precision --sequences [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEAK = 989e12  # dense bfloat16, the h200 profile's
# (tokens, in, out): the layer matmuls of widths 1024 to 16384 at 1k to 32k tokens per device
SHAPES = [
    (m, k, n)
    for m in (1024, 4096, 16384)
    for k, n in ((1024, 1024), (1024, 4096), (2304, 2304), (4096, 4096), (4096, 16384), (8192, 8192), (12288, 12288))
] + [(32768, 8192, 8192), (8192, 16384, 16384), (512, 4096, 4096), (256, 4096, 4096), (128, 4096, 4096)]


def gemms() -> dict:
    import jax
    import jax.numpy as jnp

    rows = []
    for m, k, n in SHAPES:
        flops = 2 * m * k * n
        chain = max(2, min(64, int(0.02 / (flops / (0.7 * PEAK)))) // 2 * 2)
        key = jax.random.key(0)
        x = jax.random.normal(key, (m, k), jnp.bfloat16)
        w1 = (jax.random.normal(key, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        w2 = (jax.random.normal(key, (n, k), jnp.float32) / n**0.5).astype(jnp.bfloat16)

        @jax.jit
        def run(x, w1, w2):
            for _ in range(chain // 2):  # dependent products: none can be hoisted or merged
                x = (x @ w1) @ w2
            return x

        run(x, w1, w2).block_until_ready()
        run(x, w1, w2).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run(x, w1, w2).block_until_ready()
            times.append((time.perf_counter() - start) / chain)
        t = sorted(times)[len(times) // 2]
        rows.append({"m": m, "k": k, "n": n, "seconds": t, "tflops": flops / t / 1e12, "efficiency": flops / t / PEAK})
        print(
            f"  {m:>6} x {k:>6} x {n:>6}: {t * 1e6:9.1f} us  {flops / t / 1e12:6.1f} TFLOP/s  "
            f"{flops / t / PEAK:5.1%} of peak",
            flush=True,
        )
    # t = a f + b, least squares on relative error (weights 1/t)
    import numpy as np

    f = np.array([2.0 * r["m"] * r["k"] * r["n"] for r in rows])
    t = np.array([r["seconds"] for r in rows])
    a, b = np.linalg.lstsq(np.stack([f / t, 1 / t], axis=1), np.ones_like(t), rcond=None)[0]
    fitted = {"matmul_efficiency": 1 / (a * PEAK), "matmul_overhead": float(b)}
    worst = max(abs((a * fi + b) / ti - 1) for fi, ti in zip(f, t))
    print(
        f"fit: matmul_efficiency {fitted['matmul_efficiency']:.3f}, matmul_overhead {b * 1e6:.1f} us "
        f"(worst shape off by {worst:.0%}); the profile has 0.8 and 5 us",
        flush=True,
    )
    return {"rows": rows, "fit": fitted, "worst_relative_error": float(worst), "device": str(jax.devices()[0])}


CONFIG = dict(
    vocab_size=32768,
    maxlen=1024,
    embed_dim=1024,
    num_heads=16,
    feed_forward_dim=4096,
    num_transformer_blocks=8,
    dropout_rate=0.0,
)
BATCH, SEQ = 8, 1024
PLAN = "version: 1\nmesh: {axes: {data: 1}}\ninputs: {tokens: [data, null]}\nparams: [{match: '.*', spec: []}]\n"


def sequences() -> dict:
    """The same model and tokens a step (8,192) under `compute: bfloat16` at sequences of 256, 1,024 and
    4,096: where the measured step grows with the sequence faster than the modelled one, the attention
    is what the time model misses."""
    return {
        f"{batch}x{seq}": precision(
            variants=(("bf16 compute", "precision: {compute: bfloat16}\n", True),), batch=batch, seq=seq
        )
        for batch, seq in ((32, 256), (8, 1024), (2, 4096))
    }


def parts() -> dict:
    """The bf16 step of `--precision` taken apart, each a plain `jax.jit` of a pure function: the forward
    and loss, forward and backward, the whole step (with AdamW's update), and the whole step through
    `nnx.jit` as `lm_train_step` runs it: where the time the model misses goes."""
    import jax
    from flax import nnx

    import minigpt_model
    import shardplan
    from shardplan.compose.measure import lm_loss, lm_train_step, prepare

    plan = shardplan.parse_plan(PLAN + "precision: {compute: bfloat16}\n")
    model = minigpt_model.MiniGPT(**CONFIG, rngs=nnx.Rngs(0))
    model, optimizer, tokens, targets = prepare(plan, model, BATCH, SEQ, vocab=CONFIG["vocab_size"])
    graphdef, state = nnx.split((model, optimizer))

    def forward(state, tokens, targets):
        model, _ = nnx.merge(graphdef, state)
        return lm_loss(model, tokens, targets)

    def backward(state, tokens, targets):
        model, _ = nnx.merge(graphdef, state)
        return nnx.value_and_grad(lm_loss)(model, tokens, targets)  # the gradients too, or XLA drops them

    def step(state, tokens, targets):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lm_loss)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    def timed(run, feed=False):
        nonlocal state
        times = []
        for i in range(8):
            start = time.perf_counter()
            out = run()
            if feed:
                loss, state_out = out
                loss.block_until_ready()
                state = state_out
            else:
                jax.block_until_ready(out)
            times.append(time.perf_counter() - start)
        return sorted(times[3:])[2]

    found = {}
    for name, function in (("forward", forward), ("forward and backward", backward)):
        jitted = jax.jit(function)
        found[name] = timed(lambda: jitted(state, tokens, targets))
    jitted = jax.jit(step, donate_argnums=0)
    found["step, jax.jit"] = timed(lambda: jitted(state, tokens, targets), feed=True)
    model, optimizer = nnx.merge(graphdef, state)
    found["step, nnx.jit"] = timed(lambda: lm_train_step(model, optimizer, tokens, targets))
    for name, seconds in found.items():
        print(f"  {name:24} {seconds * 1e3:7.1f} ms", flush=True)
    return found


def precision(variants=None, batch: int = BATCH, seq: int = SEQ) -> dict:
    import jax
    from flax import nnx

    import minigpt_model
    import shardplan
    import shardplan.run.step_options as step_options
    from shardplan.core.roles import recognise_module
    from shardplan.compose.measure import lm_train_step, prepare
    from shardplan.planner.cost import Workload, estimate
    from shardplan.planner.kept import with_code
    from shardplan.planner.profiles import get_profile

    results = {}
    followed = step_options.follow_plan_dtype
    for name, extra, follow in variants or (
        ("float32", "", True),
        ("bf16 compute", "precision: {compute: bfloat16}\n", True),
        ("bf16 compute, modules as built", "precision: {compute: bfloat16}\n", False),
    ):
        try:
            step_options.follow_plan_dtype = followed if follow else (lambda model, dtype: [])
            plan = shardplan.parse_plan(PLAN + extra)
            model = minigpt_model.MiniGPT(**{**CONFIG, "maxlen": max(CONFIG["maxlen"], seq)}, rngs=nnx.Rngs(0))
            roles = with_code(recognise_module(model), model, seq)
            report = shardplan.check(plan, model, input_shapes={"tokens": (batch, seq)})
            cost = estimate(report, roles, Workload(batch, seq), get_profile("h200"))
            model, optimizer, tokens, targets = prepare(plan, model, batch, seq, vocab=CONFIG["vocab_size"])
            compiled = lm_train_step.lower(model, optimizer, tokens, targets, None).compile()
            memory = compiled.memory_analysis()
            for _ in range(3):
                lm_train_step(model, optimizer, tokens, targets).block_until_ready()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                lm_train_step(model, optimizer, tokens, targets).block_until_ready()
                times.append(time.perf_counter() - start)
            step = sorted(times)[2]
            peak = (
                memory.argument_size_in_bytes
                + memory.temp_size_in_bytes
                + memory.output_size_in_bytes
                - memory.alias_size_in_bytes
            )
            row = {
                "temp_bytes": int(memory.temp_size_in_bytes),
                "argument_bytes": int(memory.argument_size_in_bytes),
                "peak_bytes": int(peak),
                "step_s": step,
                "tokens_per_s": batch * seq / step,
                "modelled_peak_bytes": cost.peak_bytes,
                "modelled_activation_bytes": cost.activation_bytes,
                "modelled_step_s": cost.step_s,
                "warnings": [d.code for d in report.diagnostics],
            }
            results[name] = row
            print(
                f"  {name:32} temp {row['temp_bytes'] / 2**30:6.2f} GiB, peak {peak / 2**30:6.2f} GiB "
                f"(modelled {cost.peak_bytes / 2**30:6.2f}), step {step * 1e3:7.1f} ms "
                f"(modelled {cost.step_s * 1e3:7.1f})",
                flush=True,
            )
        except Exception:
            traceback.print_exc()
            results[name] = {"error": traceback.format_exc()[-2000:]}
        finally:
            step_options.follow_plan_dtype = followed
            jax.clear_caches()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemms", action="store_true")
    parser.add_argument("--precision", action="store_true")
    parser.add_argument("--sequences", action="store_true", help="bf16 steps of 8,192 tokens at sequences 256 to 4,096")
    parser.add_argument("--parts", action="store_true", help="the bf16 step taken apart: forward, backward, update")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0]}", flush=True)
    out = {}
    if args.gemms:
        out["gemms"] = gemms()
    if args.precision:
        out["precision"] = precision()
    if args.sequences:
        out["sequences"] = sequences()
    if args.parts:
        out["parts"] = parts()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.precision and all("error" in row for row in out["precision"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
