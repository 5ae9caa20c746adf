"""The user's model with its repeated layers pipelined: it keeps its class, attributes and forward;
only its layer list is replaced by a `PipelinedLayers`, which the model's own loop then calls once.

`PipelinedLayers` looks like a list of one entry (itself), so `for layer in self.layers`,
`enumerate(...)`, `zip(...)` and `range(len(...))` loops run their body once, and that one call runs
every layer through the plan's schedule. Parameters keep their paths with the layer index gone:
`layers/attn/q/kernel` is (stages, chunks, layers per chunk, ...).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import warnings
from typing import Any, Callable

import jax
from flax import nnx

from shardplan.core.calls import OneEntryList
from shardplan.core.layer_contract import PipelineCallError, calling_without_updates
from shardplan.pipeline.streams import KEY as STREAMS_KEY, StoredStreams, advance, fresh_streams, step_key
from shardplan.core.paths import join_path
from shardplan.pipeline.schedules import SCHEDULES, on_tables, unit_ticks
from shardplan.pipeline.branch_probe import permutes_in_branches
from shardplan.pipeline.loop import (
    Arrangement,
    Layers,
    circular_forward,
    cross_entropy,
    fit_microbatches,
    model_order,
    Loop,
    Operands,
    one_f_one_b_loss,
    sequential_forward,
    stack,
    stage_specs,
    to_plain_tree,
    to_stacked_tree,
)
from shardplan.pipeline.constraints import pipelined_layer_code
from shardplan.pipeline.stacked import restacked, stack_returned, unstacked
from shardplan.pipeline.zero_bubble import zero_bubble_schedule
from shardplan.pipeline.zero_bubble_v import zero_bubble_v_schedule
from shardplan.plan.diagnostics import PlanWarning
from shardplan.run.accumulate import accumulated_loss
from shardplan.run.layer_call import CallArgs, describe_layer_call, draw_keys, merge_microbatches, split_microbatches
from shardplan.run.step_options import accumulation

# Set by `model_loss` under a pipeline plan: the layers then run the whole schedule, loss included.
_LOSS_REQUEST: contextvars.ContextVar = contextvars.ContextVar("shardplan_loss_request", default=None)
# Set while 1F1B runs the model's code around its layers for one microbatch: what the layers return,
# given their input.
_REPLAY: contextvars.ContextVar = contextvars.ContextVar("shardplan_replay", default=None)
# (pipeline name, manual batch axes) already told that their stages run without branches
_SAID_LOCKSTEP: set = set()


@dataclasses.dataclass
class _LossRequest:
    model: nnx.Module
    loss_of: Callable
    targets: Any
    args: tuple
    kwargs: dict
    loss: Any = None
    plain: bool = False  # the layers ran their plain forward: the loss is the model's output's


@dataclasses.dataclass(frozen=True)
class PipelineSetup:
    """What `apply_plan` decided for one pipelined layer list (hashable: it is part of the model's graph)."""

    name: str  # the list's path in the model (`blocks`, `encoder/layers`)
    stages: int
    virtual: int  # chunks of layers per stage
    mesh: Any
    axis: str  # the stage axis
    schedule: str
    microbatches: int
    batch_axes: tuple[str, ...]  # the batch axes the loop runs manually
    data_axes: tuple[str, ...]  # every batch axis
    plain_graphdef: Any  # the model's own form (its layers a list, or stacked by nnx.vmap), for `to_plain`
    counts: tuple[int, ...] | None = None  # layers per stage, where they differ
    restack: bool = False  # the model's own form stacks the layers
    split_heads: frozenset = frozenset()  # weights after the layers 1F1B may keep split
    context_axis: str | None = None  # the sequence split over it: 1F1B takes no branch
    expert_axis: str | None = None  # the expert weights stay split over it
    expert_weights: frozenset = frozenset()  # their paths within a layer


class PipelinedLayers(OneEntryList, nnx.Module):
    """The layer list of a pipelined model (see the module docstring)."""

    runs_whole_stack = True  # a scan over it (layers stacked by nnx.vmap) runs it once: `stacked.py`

    def __init__(self, layers: list[nnx.Module], setup: PipelineSetup, sharding_of: Callable | None = None):
        graphdefs = [nnx.graphdef(layer) for layer in layers]
        kinds = list(dict.fromkeys(graphdefs))
        counts = setup.counts
        arrangement = Arrangement(
            tuple(counts) if counts and len(set(counts)) > 1 else None,  # unequal: padded
            v_shape=setup.schedule == "zb-v",
        )
        stacked = nnx.merge(
            kinds[0],
            stack(
                [nnx.to_pure_dict(nnx.state(layer)) for layer in layers],
                setup.stages,
                setup.virtual,
                arrangement,
                sharding_of,
            ),
        )
        for key in nnx.state(stacked):
            setattr(self, key, getattr(stacked, key))
        self._pipeline_kinds, self._pipeline_kind_of = tuple(kinds), tuple(kinds.index(g) for g in graphdefs)
        self._pipeline_arrangement = arrangement
        self._setup = setup

    @property
    def schedule(self) -> str:
        return self._setup.schedule

    @property
    def arrangement(self) -> Arrangement:
        """Where each layer sits in the stacked arrays."""
        return self._pipeline_arrangement

    def _taken(self, index) -> Exception:  # (`OneEntryList`: the model's loop calls the pipeline once)
        return PipelineCallError(
            f"the model takes {self._setup.name}[{index!r}], but its layers are pipelined and run as one call: a "
            f"pipeline needs the forward to call every layer in order (`for layer in self.{self._setup.name}: "
            "...`)"
        )

    def __getattr__(self, name: str):
        # (only for names the stacked layers do not have: a layer's own methods, `init_cache` of a sampler)
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}: the layers at {self._setup.name} are pipelined (one "
            "call runs them all, stage by stage), so a layer's own methods are not there. To decode, or to call "
            "a layer by itself, take the plain model back (`plain = shardplan.to_plain(model)`) and place it "
            "with a plan without `pipeline:` (docs/pipelines.md, Decoding)"
        )

    def _layer_call(self, state, args: tuple, kwargs: dict):
        """The call's description, checked on one layer of each kind."""
        described = None
        for kind, graphdef in enumerate(self._pipeline_kinds):
            index = self._pipeline_kind_of.index(kind)
            layer = nnx.merge(
                graphdef, jax.tree.map(lambda a: model_order(a, self._pipeline_arrangement)[index], state)
            )
            found = describe_layer_call(layer, args, kwargs, f"{self._setup.name}/{index}")
            if described is not None and found[0] != described[0]:
                raise PipelineCallError(
                    f"the layers of {self._setup.name} differ in what they return for the same "
                    "call, so they cannot be pipelined together"
                )
            described = found
        return described

    def __call__(self, *args, **kwargs):
        return stack_returned(self._run(*args, **kwargs))

    def _run(self, *args, **kwargs):
        replay = _REPLAY.get()
        if replay is not None:
            return replay(args[0])
        state = nnx.state(self)
        call, split, whole, rngs = self._layer_call(state, args, kwargs)
        args = (call.entering(args[0]), *args[1:])
        keys = draw_keys(rngs)
        stored, rest = nnx.state(self, nnx.RngState, ...)
        streams = StoredStreams.of(jax.tree.map(lambda a: a.reshape(-1)[0], stored))
        if streams is not None:  # (the schedules carry floats only; each layer call gets streams of its own)
            state = rest
            keys = [*keys, {STREAMS_KEY: step_key(stored)}]
            advance(self)
        layers = Layers(self._pipeline_kinds, self._pipeline_kind_of, call, self._pipeline_arrangement, streams)
        request = _LOSS_REQUEST.get()
        stages, virtual = jax.tree.leaves(state)[0].shape[:2]
        micro = self._fit(args[0].shape[0])[0]
        in_a_v = self._pipeline_arrangement.v_shape  # (its loops need no group or count of microbatches)
        too_few = virtual > 1 and not in_a_v and (micro < stages if self.schedule == "interleaved" else micro % stages)
        if request is not None and not _differentiable(state):
            _warn_fixed_state(self._setup.name, self.schedule)
            request.plain = True
            request = None
        if request is not None and (too_few or not on_tables(self.schedule, self._setup.context_axis is not None)):
            # interleaved 1F1B needs whole groups of `stages` microbatches, the circular schedule a
            # microbatch per stage; a smaller batch (an evaluation) runs the layers' own forward and the
            # model's own loss instead: the same result. So does gpipe with a split sequence, where the
            # tables would run every part at every tick (no branches).
            request.plain = True
            request = None
        if request is not None:  # (the model may run on a copy of itself: compute precision)
            request.loss = self._one_f_one_b(request, layers, state, args[0], split, whole, keys)
            return call.output(args[0])  # the model's code after the layers runs on it unused (and is pruned)
        x = args[0]
        if (
            self.schedule != "gpipe"
            and request is None
            and on_tables(self.schedule, self._setup.context_axis is not None)
        ):
            _warn_without_model_loss(self.schedule)
        microbatches, batch_axes = self._fit(x.shape[0])
        if virtual > 1 and microbatches < stages and not in_a_v:
            # The circular schedule needs a microbatch per stage to loop back in time; so few rows
            # (sampling) run layer after layer instead: the same computation, without overlap.
            return call.output(sequential_forward(layers, state, x, split, whole, keys))
        ys = circular_forward(
            layers,
            state,
            split_microbatches(x, microbatches),
            [split_microbatches(a, microbatches) for a in split],
            whole,
            keys,
            mesh=self._setup.mesh,
            axis=self._setup.axis,
            batch_axes=batch_axes,
            leaf_specs=self._leaf_specs(state, batch_axes),
        )
        return call.output(merge_microbatches(ys))

    def _leaf_specs(self, state, batch_axes: tuple[str, ...]) -> tuple | None:
        """How the stacked layers enter the loop (`stage_specs`)."""
        experts = [
            join_path(path).removesuffix("/.value") in self._setup.expert_weights
            for path, _ in jax.tree.flatten_with_path(state)[0]
        ]
        return stage_specs(_specs(state), experts, self._setup.axis, batch_axes, self._setup.expert_axis)

    def _fit(self, rows: int) -> tuple[int, tuple[str, ...]]:
        """Microbatches and manual batch axes for a batch of `rows`: the plan's when they divide it; else
        (sampling one row, a small evaluation) the most microbatches that do, the batch axes left to XLA
        if a microbatch cannot be split over them. The result is the same; only the overlap differs."""
        return fit_microbatches(rows, self._setup.microbatches, self._setup.batch_axes, dict(self._setup.mesh.shape))

    def _one_f_one_b(self, request: _LossRequest, layers: Layers, state, x, split, whole, keys):
        """The 1F1B schedule with the model's own code around the layers, per microbatch: as a microbatch
        enters, the first stage replays the model's forward on its inputs up to the layers (their input
        is taken, the rest pruned); as it leaves, the last stage replays the forward with the layers
        replaced by their output (the code before them pruned). The forward on the whole batch that
        called the layers is then unused and pruned too."""
        microbatches, batch_axes = self._fit(x.shape[0])
        graphdef, params, rest = nnx.split(request.model, nnx.Param, ...)
        leaves, params_def = jax.tree.flatten(params)
        paths = [join_path(path).removesuffix("/.value") for path, _ in jax.tree.flatten_with_path(params)[0]]
        in_layers = [path.startswith(self._setup.name + "/") for path in paths]
        head_params = [leaf for leaf, inside in zip(leaves, in_layers) if not inside]
        rest_leaves, rest_def = jax.tree.flatten(rest)
        model_call, model_split, model_whole, model_rngs = CallArgs.of(request.args, request.kwargs, x.shape[0])
        mesh = self._setup.mesh
        call = layers.call
        head_keys = draw_keys(model_rngs)
        model_streams = nnx.state(request.model, nnx.RngState)
        if jax.tree.leaves(model_streams):  # (streams the model keeps: each microbatch's replay gets its own)
            head_keys = [*head_keys, {STREAMS_KEY: step_key(model_streams)}]
        outside = [i for i, inside in enumerate(in_layers) if not inside]

        def replayed(head_params, rest_leaves, layers_return, split, whole, keys, used):
            # Weights the head does not read are placeholders: the layers' (never touched, the layers
            # replay their output), and zeros for the code before the layers (run, then pruned as dead).
            given = dict(zip(used if used is not None else outside, head_params))
            full = [
                given[i] if i in given else 0 if in_layers[i] else jax.numpy.zeros(leaves[i].shape, leaves[i].dtype)
                for i in range(len(in_layers))
            ]
            if keys and STREAMS_KEY in keys[-1]:  # (folded for this microbatch; the whole-batch forward counted on)
                keys, rest_leaves = keys[:-1], fresh_streams(rest_leaves, keys[-1][STREAMS_KEY])
            model = nnx.merge(graphdef, jax.tree.unflatten(params_def, full), jax.tree.unflatten(rest_def, rest_leaves))
            args, kwargs = model_call.rebuild(split, whole, keys)
            token = _REPLAY.set(layers_return)
            try:
                with pipelined_layer_code():  # (it runs inside the stages too)
                    return calling_without_updates(
                        model,
                        lambda: model(*args, **kwargs),
                        "the model",
                        "under 1f1b (which replays its forward per microbatch) it",
                        streams=True,
                    )
            finally:
                _REPLAY.reset(token)

        def head_loss(head_params, rest_leaves, h, split, whole, keys, targets, *, used=None):
            out = replayed(head_params, rest_leaves, lambda _: call.output(h), split, whole, keys, used)
            return request.loss_of(out, targets)

        def layers_entry(params, rest_leaves, split, whole, keys, *, used=None):
            entering = []
            replayed(
                params,
                rest_leaves,
                lambda x: entering.append(call.entering(x)) or call.output(x),
                split,
                whole,
                keys,
                used,
            )
            return entering[0]

        def micro(a):
            return split_microbatches(a, microbatches)

        def first(a):
            return micro(a)[0]

        sample = ([first(a) for a in model_split], model_whole, head_keys)
        # Only the weights the head reads enter the pipeline for the head, and only those the code before
        # the layers reads for it (each replayed per microbatch: the rest of the model's forward is pruned).
        # A weight split over tensor axes only keeps its split (the loop leaves those axes to XLA): a
        # vocabulary-parallel embedding and head stay so, as in Megatron. The rest enter whole: in jax
        # 0.10.2 XLA's partitioner aborts the process (a failed check) on a head split over an automatic
        # batch axis, on a weight both the head and the code before the layers read (a tied embedding), and
        # on the training step of a split embedding while a batch axis is left to XLA (FSDP-split layers).
        used = _used_inputs(
            lambda params: head_loss(params, rest_leaves, first(x), *sample[:2], head_keys, first(request.targets)),
            head_params,
        )
        before = _used_inputs(lambda params: jax.numpy.sum(layers_entry(params, rest_leaves, *sample)), head_params)
        every_batch_axis_manual = batch_axes == self._setup.data_axes
        # (with the sequence split over a context axis, or a batch axis left to XLA for a small batch, a split
        # head aborted XLA's partitioner too: it enters whole)
        may_split = [
            every_batch_axis_manual and paths[i] in self._setup.split_heads and self._setup.context_axis is None
            for i in outside
        ]
        split_ok = [may and not read_before for may, read_before in zip(may_split, before)]
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def entering(reads, keeps_split):  # the weights one part reads, each split or whole
            return [
                p if keep else jax.lax.with_sharding_constraint(p, replicated)
                for p, read, keep in zip(head_params, reads, keeps_split)
                if read
            ]

        head_in = entering(used, split_ok)
        embed_in = entering(before, [may and not by_head for may, by_head in zip(may_split, used)])
        used_at = [i for i, keep in zip(outside, used) if keep]
        read_at = [i for i, read in zip(outside, before) if read]
        leaf_specs = self._leaf_specs(state, batch_axes)
        branches = self._setup.context_axis is None and not self._permutes_in_branches(
            layers, state, x, split, whole, keys, microbatches, batch_axes, leaf_specs, every_batch_axis_manual
        )
        # each layer's gradients added into the running sums inside the branch (one buffer), where XLA
        # has no batch axis of its own there (on CPU, a layout whose sums need a permute runs in lockstep)
        sums_in_branches = branches and every_batch_axis_manual
        loop = Loop(
            layers,
            functools.partial(head_loss, used=used_at),
            functools.partial(layers_entry, used=read_at),
            mesh,
            self._setup.axis,
            tuple(batch_axes),
            self.schedule,
            embed_branch=every_batch_axis_manual and branches,
            branches=branches,
            sums_in_branches=sums_in_branches,
            leaf_specs=leaf_specs,
            send_axes=self._send_axes(mesh, batch_axes) if every_batch_axis_manual and branches else (),
        )
        operands = Operands(
            state,
            head_in,
            embed_in,
            rest_leaves,
            ([micro(a) for a in split], whole),
            ([micro(a) for a in model_split], model_whole),
            micro(request.targets),
            (keys, head_keys),
        )
        # (1F1B on unit ticks takes its branches: without them every stage would compute F, B and W at every tick)
        virtual = jax.tree.leaves(state)[0].shape[1]
        unit = unit_ticks(self.schedule, virtual) and (branches or self.schedule == "zb-h1")
        runner = zero_bubble_schedule if unit else {"zb-v": zero_bubble_v_schedule}.get(self.schedule)
        return one_f_one_b_loss(loop, operands, runner)

    def _send_axes(self, mesh, batch_axes) -> tuple[str, ...]:
        """The axes a stage send is split over: those the loop leaves to XLA that split neither the batch
        nor the sequence (the tensor axes)."""
        skip = {self._setup.axis, *batch_axes, *self._setup.data_axes, self._setup.context_axis}
        return tuple(n for n in mesh.axis_names if n not in skip and mesh.shape[n] > 1)

    @staticmethod
    def _one_microbatch(x, split: list, whole, keys, microbatches: int) -> tuple:
        """(activation, split inputs, whole inputs, keys) of one microbatch, as shapes."""
        rows = x.shape[0] // microbatches

        def one_microbatch(a):
            return jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype)

        return one_microbatch(x), [one_microbatch(a) for a in split], whole, keys

    def _permutes_in_branches(
        self,
        layers,
        state,
        x,
        split,
        whole,
        keys,
        microbatches: int,
        batch_axes: tuple[str, ...],
        leaf_specs: tuple | None,
        sums_inside: bool,
    ) -> bool:
        """Whether the schedule must run without branches on this backend (see `branch_probe`), said once
        per pipeline and layout: where XLA:CPU needs a permute to run a chunk, or (`sums_inside`, the
        running sums to go in the branch) to add its gradients into the sums. (A layout whose sums XLA
        re-tiles can re-tile the residuals the backward reads back too, in ways a chunk compiled alone
        does not show: `python -m tests.combinations --seed 9501`, case 400, aborted with its sums kept
        outside the branch. Every stage computing at every tick gives the same numbers.)"""
        probe = (layers, state, _specs(state), self._one_microbatch(x, split, whole, keys, microbatches))
        where = (self._setup.mesh, self._setup.axis, batch_axes, leaf_specs)
        if not permutes_in_branches(False, *probe, *where) and not (
            sums_inside and permutes_in_branches(True, *probe, *where)
        ):
            return False
        if (self._setup.name, batch_axes) not in _SAID_LOCKSTEP:
            _SAID_LOCKSTEP.add((self._setup.name, batch_axes))
            warnings.warn(
                f"pipeline {self._setup.name!r} on CPU devices: XLA splits its layers, or re-tiles their "
                "gradients, with a collective-permute over an axis left to it, which XLA:CPU cannot run inside the "
                "schedule's branches, so every stage computes at every tick and keeps its own work: the "
                "same numbers, more computation (accelerators keep the branches)",
                PlanWarning,
                stacklevel=4,
            )
        return True


def _specs(state) -> list:
    """The plan's spec of each leaf of the stacked layers."""
    return jax.tree.leaves(nnx.get_partition_spec(state), is_leaf=lambda v: isinstance(v, jax.sharding.PartitionSpec))


def _used_inputs(function: Callable, leaves: list) -> list[bool]:
    """Which of `leaves` the scalar `function(leaves)` depends on, after dead code is removed."""
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr

        closed = jax.make_jaxpr(function)(leaves)
        return list(dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))[1])
    except Exception:  # jax internals moved: keep every input (correct, if slower)
        return [True] * len(leaves)


def pipelined_layers(model) -> tuple[str, PipelinedLayers] | None:
    """(path, layers) of a model whose layers `apply_plan` pipelined (an attribute of the model, `blocks`,
    or nested, `encoder/layers`); None for any other model."""
    if not isinstance(model, nnx.Module):
        return None
    for path, value in nnx.iter_graph(model):
        if isinstance(value, PipelinedLayers):
            return join_path(path), value
    return None


def to_plain(model: nnx.Module) -> nnx.Module:
    """The model with its layers unpipelined, same weights (for sampling and export); any other model as is.

    >>> import shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_pp4.yaml")
    >>> model = minigpt_model.MiniGPT(vocab_size=512, num_transformer_blocks=8, rngs=nnx.Rngs(0))
    >>> model = shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))
    >>> type(model.transformer_blocks).__name__, model.transformer_blocks.linear1.kernel.shape
    ('PipelinedLayers', (4, 1, 2, 256, 256))
    >>> plain = shardplan.to_plain(model)
    >>> len(plain.transformer_blocks), plain.transformer_blocks[0].linear1.kernel.shape
    (8, (256, 256))
    """
    found = pipelined_layers(model)
    if found is None:
        return model
    return nnx.merge(found[1]._setup.plain_graphdef, plain_tree(model, nnx.to_pure_dict(nnx.state(model))))


def plain_tree(model: nnx.Module, tree: dict) -> dict:
    """A pure dict laid out as `model`'s state (its gradients, an optimizer moment) in the layout of the
    model unpipelined: the layers a list again, or stacked again where the model stacks them (`nnx.vmap`);
    any other model's as is.

    >>> import jax, shardplan, minigpt_model
    >>> from flax import nnx
    >>> plan = shardplan.load_plan("plans/minigpt_pp4.yaml")
    >>> model = minigpt_model.MiniGPT(vocab_size=512, num_transformer_blocks=8, rngs=nnx.Rngs(0))
    >>> model = shardplan.apply_plan(plan, model, shardplan.make_mesh(plan))
    >>> grads = jax.tree.map(jax.numpy.zeros_like, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    >>> shardplan.plain_tree(model, grads)["transformer_blocks"][7]["linear1"]["kernel"].shape
    (256, 256)
    """
    found = pipelined_layers(model)
    if found is None:
        return tree
    name, layers = found
    tree = to_plain_tree(tree, name, layers.arrangement)
    return restacked(tree, name) if layers._setup.restack else tree


def pipelined_tree(model: nnx.Module, plain: dict, like: dict) -> dict:
    """Inverse of `plain_tree`: a pure dict in the unpipelined model's layout (a checkpoint's) -> `model`'s,
    each array placed as its counterpart in `like` (a pure dict of the model's own state, or its shapes
    with shardings); any other model's `plain` as is."""
    found = pipelined_layers(model)
    if found is None:
        return plain
    name, layers = found
    if layers._setup.restack:
        plain = unstacked(plain, name)
    return to_stacked_tree(plain, like, name, layers.arrangement)


def _differentiable(state) -> bool:
    """Whether every array of the stacked layers (their RNG streams taken out, `streams.py`) is a float: the
    tables' gradient sums cannot hold integer variables of a layer's own."""
    return all(jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in jax.tree.leaves(state))


@functools.cache
def _warn_fixed_state(name: str, schedule: str) -> None:
    warnings.warn(
        f"pipeline {name!r}: its layers keep state that is neither a float nor an RNG stream (an integer "
        f"variable of their own), which the {schedule} schedule's tables cannot run yet; the step "
        "runs the circular (gpipe) forward with autodiff instead: the same numbers, every microbatch's "
        "activations kept until the backward",
        PlanWarning,
        stacklevel=5,
    )


@functools.cache
def _warn_without_model_loss(schedule: str) -> None:
    """Once per schedule: its tables run only where the step asks for the loss through `model_loss`."""
    import warnings

    from shardplan.plan.diagnostics import PlanWarning

    warnings.warn(
        f"the plan's pipeline schedule {schedule!r} runs only inside shardplan.model_loss; this call of the "
        f"model runs the {'V-shaped' if schedule == 'zb-v' else 'circular (gpipe)'} forward instead: the "
        "same numbers, but every microbatch's "
        "activations kept until the backward (more memory). In a training step, compute the loss with "
        "shardplan.model_loss(model, loss_of, targets, *inputs); evaluation and sampling need nothing",
        PlanWarning,
        stacklevel=4,
    )


def model_loss(model: nnx.Module, loss_of: Callable, targets, *args, **kwargs):
    """Mean `loss_of(model(*args, **kwargs), targets)` over the batch, for any model.

    Under a pipeline plan the loss is computed inside the pipeline, at the last stage as each
    microbatch arrives; the model's own code after its layers runs there per microbatch, and the code
    before them on the first stage as it enters. Under `accumulate: N` the batch runs as N
    microbatches in turn, their gradients summed as they come. In both cases
    `loss_of` must be a mean over the rows, as cross-entropy is. Otherwise this is exactly the
    expression above.

    >>> import numpy as np, shardplan, minigpt_model
    >>> from flax import nnx
    >>> from shardplan.pipeline.loop import cross_entropy
    >>> model = minigpt_model.MiniGPT(maxlen=8, vocab_size=64, embed_dim=16, num_heads=2, feed_forward_dim=16,
    ...                               num_transformer_blocks=2, rngs=nnx.Rngs(0))
    >>> tokens = np.zeros((2, 8), np.int32)
    >>> float(shardplan.model_loss(model, cross_entropy, tokens, tokens)) > 0
    True
    """
    found = pipelined_layers(model)
    if found is None and accumulation(model) > 1:
        return accumulated_loss(
            model,
            lambda output, part: loss_of(_split_over_rows_only(output), part),
            targets,
            args,
            kwargs,
            accumulation(model),
        )
    if found is None or found[1].schedule not in SCHEDULES:
        return loss_of(_split_over_rows_only(model(*args, **kwargs)), targets)
    request = _LossRequest(model, loss_of, targets, args, kwargs)
    token = _LOSS_REQUEST.set(request)
    try:
        output = model(*args, **kwargs)
    finally:
        _LOSS_REQUEST.reset(token)
    if request.plain:
        return loss_of(_split_over_rows_only(output), targets)
    if request.loss is None:
        raise PipelineCallError(f"the model's forward never called its pipelined layers ({found[0]})")
    return request.loss


def _split_over_rows_only(output):
    """The model's output with explicit mesh axes (`mesh.types`) kept on its leading, batch, dimension only:
    under explicit axes a loss that indexes a split dimension (cross-entropy with integer labels gathers
    along the vocabulary) cannot resolve its sharding, and JAX refuses it (found by the combination tester:
    a head split over an explicit axis). Outputs of automatic axes are returned as they are."""

    def one(a):
        sharding = getattr(jax.typeof(a), "sharding", None) if isinstance(a, jax.Array) else None
        spec = tuple(getattr(sharding, "spec", ()) or ())
        if len(spec) < 2 or all(entry is None for entry in spec[1:]):
            return a
        return jax.sharding.reshard(a, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[0])))

    return jax.tree.map(one, output)


__all__ = [
    "PipelineSetup",
    "PipelinedLayers",
    "pipelined_layers",
    "to_plain",
    "plain_tree",
    "pipelined_tree",
    "model_loss",
    "cross_entropy",
]
