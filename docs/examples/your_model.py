"""Your own NNX model and training loop, sharded by plans (docs/your-model.md walks through it).

Run it as it is: `python docs/examples/your_model.py` (8 simulated CPU devices, under a minute). It trains
a small LLaMA-style decoder for three AdamW steps under each plan below, with your own step function
compiled once by `shardplan.jit_step` (a plain `@nnx.jit` works too, at the cost of a graph walk every
call), and checks every plan's losses against one device's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardplan


# ------------------------------------------------------------------ your model: nothing about sharding
class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, use_bias=False, decode=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.gate = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
    def __init__(
        self, vocab: int = 128, dim: int = 64, heads: int = 4, hidden: int = 128, depth: int = 4, *, rngs: nnx.Rngs
    ):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, hidden, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ------------------------------------------------------------------ the plans, as files would hold them
DP_TP = """
version: 1
mesh: {axes: {data: 4, model: 2}}
inputs: {tokens: [data, null]}
params:
  - {match: 'blocks/\\d+/attn/(query|key|value)/kernel', spec: [null, model, null]}   # heads over model
  - {match: 'blocks/\\d+/attn/out/kernel', spec: [model, null, null]}
  - {match: 'blocks/\\d+/(gate|up)/kernel', spec: [null, model]}                     # Megatron MLP
  - {match: 'blocks/\\d+/down/kernel', spec: [model, null]}
  - {match: '.*', spec: replicated}
"""

FSDP = """
version: 1
mesh: {axes: {data: 8}}
inputs: {tokens: [data, null]}
params:
  - {match: 'blocks/\\d+/attn/out/kernel', spec: [null, null, data]}   # [heads 4, head_dim, dim]: dim
  - {match: '.*kernel|.*embedding', spec: [data]}       # every other matrix over data on its first dim
  - {match: '.*', spec: replicated}
optimizer: same
"""

PIPELINE = """
version: 1
mesh: {axes: {stage: 2, data: 4}}
inputs: {tokens: [data, null]}
pipeline: {axis: stage, layers: blocks, microbatches: 4, schedule: 1f1b}
params:
  - {match: '.*', spec: replicated}
"""


# ------------------------------------------------------------------ your loop: your own step function
def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def loss_fn(model, tokens, targets):
    # `model_loss` is `cross_entropy(model(tokens), targets)`; under a 1f1b pipeline it runs the schedule
    return shardplan.model_loss(model, cross_entropy, targets, tokens)


def train_step(model, optimizer, tokens, targets):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets)
    optimizer.update(model, grads)  # shard_optimizer's update keeps every array on the plan's layout
    return loss


def train(plan_text: str | None, steps: int = 3) -> list[float]:
    build = lambda: Decoder(rngs=nnx.Rngs(0))  # noqa: E731
    rows = np.asarray(jax.random.randint(jax.random.key(1), (16, 33), 0, 128))
    if plan_text is None:  # one device, as you would run it without shardplan
        model = build()
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        tokens, targets = rows[:, :-1], rows[:, 1:]
    else:
        plan = shardplan.parse_plan(plan_text)
        mesh = shardplan.make_mesh(plan)
        report = shardplan.check(plan, nnx.eval_shape(build), mesh)  # never raises: read the diagnostics
        assert report.ok, [d.format() for d in report.diagnostics]
        model = shardplan.init(plan, build, mesh)  # built on its shards
        optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
        tokens, targets = shardplan.shard_inputs(plan, (rows[:, :-1], rows[:, 1:]), mesh)
    # compiled once over the model's and optimizer's state; each call updates them in place
    step = shardplan.jit_step(train_step, model, optimizer)
    return [float(step(tokens, targets)) for _ in range(steps)]


if __name__ == "__main__":
    shardplan.simulate_cpu_devices(8)  # before anything starts JAX; with accelerators, leave this out
    reference = train(None)
    print("one device     ", " ".join(f"{loss:.6f}" for loss in reference))
    for name, text in (("data x tensor", DP_TP), ("FSDP", FSDP), ("1F1B pipeline", PIPELINE)):
        losses = train(text)
        print(f"{name:15}", " ".join(f"{loss:.6f}" for loss in losses))
        np.testing.assert_allclose(losses, reference, rtol=2e-5)
    print("every plan trains like one device")
