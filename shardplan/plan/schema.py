"""Plan format v1 as pydantic models: the single source of the JSON Schema and of type checks.

Vocabulary: an *axis* is a mesh axis, a *dim* is a tensor dimension, a *rule* maps a path
regex to a *spec* (one entry per dim), a *stage* is a pipeline stage, a *layer* one of the
repeated modules a pipeline cuts into stages.
"""

from __future__ import annotations

import math

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator

# A spec entry: null or "_" (dim not sharded), an axis name, or a list of axis names
# (dim sharded over their product, major to minor).
SpecEntry = Annotated[
    Union[None, str, list[str]],
    Field(
        title="Spec entry",
        description="One dim: null or '_' (not sharded), a mesh axis name, or a list of axis names "
        "(the dim split over their product). Numbers and mappings are not spec entries.",
    ),
]
UNSHARDED = "_"
# Mesh axis names: an identifier (so `_`, which means "not sharded" in specs, cannot be one).
AXIS_NAME = r"^[A-Za-z][A-Za-z0-9_-]*$"
AxisName = Annotated[str, Field(pattern=AXIS_NAME, max_length=64)]
# The largest mesh shardplan lays out; bigger ones are refused before any device or JAX is touched.
MAX_MESH_DEVICES = 1 << 17


class _Strict(BaseModel):
    # strict: `true` is not the number 1, "8" is not 8 (YAML and TOML give real numbers)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelRef(_Strict):
    factory: str = Field(
        description="`module:callable` that builds the model; called with `rngs=` when it accepts it.",
        pattern=r"^[\w.]+:[\w.]+$",
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the factory.")


def _axis_map_schema(sizes: dict):
    """JSON Schema of an axis -> count map: names checked by `propertyNames` (patternProperties would let
    other names through), counts by `sizes`."""

    def edit(schema: dict) -> None:
        schema.pop("patternProperties", None)
        schema["propertyNames"] = {"pattern": AXIS_NAME, "maxLength": 64}
        schema["additionalProperties"] = sizes

    return edit


_AXIS_SIZE = {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": MAX_MESH_DEVICES}]}
_HOST_COUNT = {"type": "integer", "minimum": 1, "maximum": MAX_MESH_DEVICES}


class MeshConfig(_Strict):
    axes: dict[AxisName, int] = Field(
        description="Mesh axis name -> size, in mesh order; at most one size may be -1 "
        "(filled with the remaining devices; JSON Schema cannot say 'at most "
        "one', shardplan checks it).",
        min_length=1,
        json_schema_extra=_axis_map_schema(_AXIS_SIZE),
    )
    types: dict[AxisName, Literal["auto", "explicit"]] = Field(
        default_factory=dict,
        description="Axis name -> how JAX treats it: auto (default; XLA's partitioner places "
        "what the plan does not) or explicit (shardings are part of array types; ops it cannot resolve need an "
        "output sharding, which `activations` rules give their modules).",
    )
    hosts: dict[AxisName, int] = Field(
        default_factory=dict,
        json_schema_extra=_axis_map_schema(_HOST_COUNT),
        description=(
            "Axis name -> how many hosts it spans. These axes cross the slow links between hosts; all other axes "
            "stay within a host. The product is the number of hosts (processes)."
        ),
    )

    @field_validator("axes")
    @classmethod
    def _sizes(cls, axes: dict[str, int]) -> dict[str, int]:
        bad = {name: size for name, size in axes.items() if (size < 1 and size != -1) or size > MAX_MESH_DEVICES}
        if bad:
            raise ValueError(f"mesh axis sizes must be -1 or from 1 to {MAX_MESH_DEVICES}, but got {bad}")
        if list(axes.values()).count(-1) > 1:
            raise ValueError(
                f"at most one mesh axis may have size -1, but got {[n for n, s in axes.items() if s == -1]}"
            )
        return axes


class ParamRule(_Strict):
    match: str = Field(
        description="Regular expression that must fully match a parameter path "
        "(e.g. `transformer_blocks/\\d+/linear1/kernel`)."
    )
    spec: Union[Literal["replicated", "annotated"], list[SpecEntry]] = Field(
        description="One entry per leading dim: null/'_' (not sharded), an axis, or a list of axes; "
        "'replicated' is shorthand for []; 'annotated' takes the model's own annotation "
        "(nnx.with_partitioning), its logical names resolved through logical_axes."
    )

    @field_validator("spec", mode="before")
    @classmethod
    def _spec_shape(cls, spec: Any) -> Any:
        return spec if spec == "annotated" else check_spec_shape(spec, allow_replicated=True)

    @property
    def normal(self) -> NormalSpec:
        """The spec as per-dim axis tuples (`normalize_spec`; 'annotated': ())."""
        return normalize_spec(self.spec)


class VariableRule(_Strict):
    match: str = Field(
        description="Regular expression that must fully match the path of a variable that is not a parameter: "
        "a cache (`blocks/\\d+/attn/cached_(key|value)`), batch statistics (`bn/mean`), RNG state, or a "
        "user's own `nnx.Variable` kind."
    )
    spec: Union[Literal["replicated"], list[SpecEntry]] = Field(
        description="One entry per leading dim, as for parameters. Variables no rule matches are replicated."
    )

    @field_validator("spec", mode="before")
    @classmethod
    def _spec_shape(cls, spec: Any) -> Any:
        return check_spec_shape(spec, allow_replicated=True)

    @property
    def normal(self) -> NormalSpec:
        return normalize_spec(self.spec)


DTYPES = ("int32", "int64", "uint8", "bool", "float32", "float16", "bfloat16")


class InputSpec(_Strict):
    spec: list[SpecEntry] = Field(description="The input's spec: one entry per leading dim.")
    shape: list[Annotated[int, Field(ge=1, le=1 << 31)]] | None = Field(
        default=None,
        max_length=16,
        description="Shape of one batch of this input; with it, `check` traces one "
        "call of the model on zeros of this shape (a pipeline plan is then checked against how the model calls "
        "its layers).",
    )
    dtype: Literal[DTYPES] = Field(default="int32", description="dtype of the example input (tokens: int32).")

    @field_validator("spec", mode="before")
    @classmethod
    def _spec_shape(cls, spec: Any) -> Any:
        return check_spec_shape(spec, allow_replicated=False)

    @field_validator("shape")
    @classmethod
    def _elements(cls, shape: list[int] | None) -> list[int] | None:
        # each dim within its bound can still multiply past what XLA's shapes hold (it aborted the process)
        if shape is not None and math.prod(shape) > MAX_INPUT_ELEMENTS:
            raise ValueError(
                f"an input shape of {math.prod(shape):,} elements; at most {MAX_INPUT_ELEMENTS:,} (2**40) per input"
            )
        return shape


MAX_INPUT_ELEMENTS = 1 << 40


def input_spec(raw: "list | InputSpec") -> list:
    """The spec of a plan input, written either as a spec or as {spec, shape, dtype}."""
    return raw.spec if isinstance(raw, InputSpec) else raw


def input_example(raw: "list | InputSpec") -> tuple[tuple[int, ...], str] | None:
    """(shape, dtype) of a plan input's example batch, or None when the plan gives no shape."""
    if isinstance(raw, InputSpec) and raw.shape is not None:
        return tuple(raw.shape), raw.dtype
    return None


class StageRule(_Strict):
    match: str = Field(
        description="Regular expression that must fully match a layer path (e.g. `transformer_blocks/[0-3]`)."
    )
    stage: int = Field(ge=0, le=MAX_MESH_DEVICES, description="Pipeline stage (0-based) of the matched layers.")


class PipelineConfig(_Strict):
    axis: str = Field(description="Mesh axis whose devices hold the stages.")
    layers: str = Field(description="Path of the list of repeated, identically-shaped layers.")
    stages: Union[Literal["even"], list[StageRule]] = Field(
        default="even", description="Ordered stage rules (first full match wins) or 'even'."
    )
    microbatches: int = Field(default=1, ge=1, le=4096, description="Microbatches per step.")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"] = Field(
        default="gpipe",
        description="Pipeline schedule (zb-h1: 1F1B with each backward split into its input "
        "and weight gradients, the latter filling 1F1B's idle ticks; zb-v: two "
        "chunks per device in a V, zero-bubble at 1F1B's activation memory).",
    )
    virtual_stages: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Chunks of layers per device: with 1f1b, "
        "Megatron's interleaved 1F1B (microbatches a multiple of the stages); with "
        "interleaved, the circular schedule. gpipe and zb-h1 have one chunk per device, "
        "zb-v two.",
    )

    @property
    def chunks(self) -> int:
        """Chunks of layers per device: zb-v's two, else `virtual_stages` (1 where the schedule has one)."""
        return 2 if self.v_shaped else self.virtual_stages

    @property
    def v_shaped(self) -> bool:
        """zb-v: each device's two chunks in a V (the first going down the stages, the second back up)."""
        return self.schedule == "zb-v"

    @property
    def zero_bubble(self) -> bool:
        """zb-h1 and zb-v: each backward split into its input and weight gradients, run apart."""
        return self.schedule in ("zb-h1", "zb-v")

    @property
    def label(self) -> str:
        """The schedule as the field calls it: `1f1b` with chunks is Megatron's interleaved 1F1B, and
        `interleaved` with chunks the circular schedule."""
        if self.virtual_stages > 1:
            return {"1f1b": "interleaved 1f1b", "interleaved": "circular"}.get(self.schedule, self.schedule)
        return self.schedule

    @model_validator(mode="after")
    def _chunks_need_a_schedule_for_them(self) -> "PipelineConfig":
        if self.schedule in ("gpipe", "zb-h1") and self.virtual_stages > 1:
            raise ValueError(
                f"{self.schedule} runs one chunk of layers per device, so "
                f"virtual_stages {self.virtual_stages} would do nothing: "
                "use schedule 1f1b (Megatron's interleaved 1F1B) or interleaved "
                "(the circular schedule), or leave virtual_stages out"
            )
        if self.schedule == "zb-v" and self.virtual_stages not in (1, 2):
            raise ValueError(
                f"zb-v runs two chunks of layers per device, in a V, so virtual_stages "
                f"{self.virtual_stages} cannot hold: leave virtual_stages out (or write 2)"
            )
        return self


# jax.checkpoint_policies names a remat rule may use, besides `none` and `full`. (The offload policies
# take memory kinds as arguments and need a backend with host offload; they are not offered.)
REMAT_POLICIES = (
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "nothing_saveable",
    "everything_saveable",
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
    # shardplan's own: torchtitan's selective op checkpointing (`shardplan.run.every_other_dot`)
    "every_other_dot_saveable",
)
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class ActivationRule(_Strict):
    match: str = Field(
        description="Regular expression that must fully match a module path (e.g. "
        "`transformer_blocks/\\d+/layer_norm1`); the module's output gets `spec`."
    )
    spec: list[SpecEntry] = Field(
        description="Spec of the module's output (e.g. [data, model, null]: batch over "
        "data, sequence over model: sequence parallelism)."
    )

    @field_validator("spec", mode="before")
    @classmethod
    def _spec_shape(cls, spec: Any) -> Any:
        return check_spec_shape(spec, allow_replicated=False)

    @property
    def normal(self) -> NormalSpec:
        """The spec as per-dim axis tuples (`normalize_spec`)."""
        return normalize_spec(self.spec)


class RematRule(_Strict):
    match: str = Field(
        description="Regular expression that must fully match a module path (e.g. `transformer_blocks/\\d+`)."
    )
    policy: Literal[("none", "full") + REMAT_POLICIES] = Field(
        description="none: keep what autodiff keeps; full: recompute everything in the backward; a "
        "jax.checkpoint_policies name (what to save); or every_other_dot_saveable: the 1st, 3rd, ... weight "
        "matmuls' outputs of each layer kept, the rest recomputed (torchtitan's selective op checkpointing)."
    )


class Precision(_Strict):
    params: Literal[FLOAT_DTYPES] | None = Field(
        default=None, description="dtype parameters are stored in (and optimizer state follows); default: as built."
    )
    compute: Literal[FLOAT_DTYPES] | None = Field(
        default=None,
        description="dtype the forward and backward run in: floating parameters are cast to it for "
        "the call (gradients reach the stored parameters in their dtype), and modules that "
        "compute in their parameters' dtype (flax's nnx.Embed) compute in it; outputs come "
        "back in the parameters' dtype.",
    )
    master: Literal["float32"] | None = Field(
        default=None,
        description="Keep float32 master weights in the optimizer state (split with the moments "
        "under `optimizer: zero1`, moments in float32 too): the optimizer updates them in float32 and writes the "
        "stored parameters (`params`, e.g. bfloat16) as their rounding, as Megatron's distributed optimizer does. "
        "Needs `params` narrower than float32. Gradients come in the parameters' dtype.",
    )

    @model_validator(mode="after")
    def _master_over_narrow_params(self) -> "Precision":
        if self.master is not None and self.params in (None, "float32", "float64"):
            raise ValueError(
                "`master: float32` keeps float32 copies of parameters stored narrower: set "
                "`params` to bfloat16 or float16 as well"
            )
        return self


class ExpertsConfig(_Strict):
    blocks: str = Field(
        description="Regular expression that must fully match the module path of each mixture-of-"
        "experts block (e.g. `layers/\\d+/moe`). A block holds a router weight [D, E] and "
        "expert weights stacked on a leading dim of E, and runs its experts through "
        "jax.lax.ragged_dot on rows sorted by expert (docs/experts.md)."
    )
    axis: AxisName = Field(
        description="Mesh axis the experts are split over: each device holds E / size of them. "
        "Its own axis, or the data axis (experts folded onto data parallelism)."
    )
    dispatch: Literal["dropless", "capacity"] = Field(
        default="dropless",
        description="dropless: every routed token reaches its expert (each device's exchange "
        "has room for all its tokens at every expert); capacity: room for capacity_factor x the uniform share, "
        "rows beyond it dropped (their expert output is zero), as GShard, MaxText and Megatron do.",
    )
    capacity_factor: float | None = Field(
        default=None,
        gt=0,
        le=64,
        description="With dispatch: capacity, slots per (device, expert) as a multiple "
        "of the rows a uniform router sends there (1.25 is common).",
    )
    router: str | None = Field(
        default=None,
        description="Regular expression that must fully match the router weight's path within "
        "each block (e.g. `gate/kernel`), where the shapes leave it ambiguous; by default the block's 2-D weight, "
        "not a bias, whose width leads its expert stacks.",
    )
    weights: str | None = Field(
        default=None,
        description="Regular expression that must fully match, within each block, the paths of its "
        "expert weights (dim 0 is E); by default the stacks of rank 3 or more that lead with the router's "
        "width and the 2-D per-expert biases beside them.",
    )

    @model_validator(mode="after")
    def _capacity_given(self) -> "ExpertsConfig":
        if (self.dispatch == "capacity") != (self.capacity_factor is not None):
            raise ValueError("dispatch: capacity needs a capacity_factor, and only it takes one")
        return self


class ContextConfig(_Strict):
    axis: AxisName = Field(
        description="Mesh axis the sequence is split over: each device holds sequence / size "
        "of every activation's rows. The batch inputs name it on their sequence dim."
    )
    strategy: Literal["all_gather", "ring"] = Field(
        default="all_gather",
        description="all_gather: queries stay split, keys and values are gathered over the "
        "axis before attention (any attention code; derived from the query, key and value projections). ring: keys "
        "and values travel around the axis, one block per step, merged with an online softmax, so no device holds "
        "the whole sequence's keys or scores (attention through nnx.MultiHeadAttention, nnx.dot_product_attention "
        "or jax.nn.dot_product_attention).",
    )
    load_balance: bool = Field(
        default=False,
        description="Lay the sequence out so each device holds a head and a tail chunk (device i: "
        "chunks i and 2 x size - 1 - i), which evens out a causal mask's work. `shard_inputs` reorders every "
        "sequence dim of the inputs; the model must take its positions and masks from its inputs.",
    )


class Plan(_Strict):
    """A parsed plan. `locate(...)` maps a key path to its file position."""

    version: Literal[1] = Field(description="Plan format version.")

    @field_validator("version", mode="before")
    @classmethod
    def _exactly_one(cls, version: Any) -> Any:
        if type(version) is not int:  # Literal[1] would take `true` and 1.0
            raise ValueError(f"version must be the integer 1, but got {version!r}")
        return version

    name: str | None = Field(default=None, description="Human-readable plan name.")
    model: ModelRef | None = Field(default=None, description="Default model for the command line.")
    mesh: MeshConfig = Field(description="The device mesh.")
    inputs: dict[str, Union[list[SpecEntry], InputSpec]] = Field(
        default_factory=dict,
        description="Spec of each batch input, by name; or {spec, shape, dtype} to give an example batch too.",
    )
    params: list[ParamRule] = Field(min_length=1, description="Ordered rules; the first full match wins.")
    unmatched: Literal["error", "warn", "replicate"] = Field(
        default="error", description="What happens to a parameter no rule matches."
    )
    variables: list[VariableRule] = Field(
        default_factory=list,
        description="Ordered rules for the variables that are not parameters (caches, batch statistics, RNG "
        "state, a user's own kinds); the first full match wins; the rest are replicated. Caches a model "
        "makes later (`init_cache`) are placed by `shardplan.place_variables`.",
    )
    optimizer: Literal["same", "zero1"] = Field(
        default="same",
        description="same: optimizer state mirrors its parameter; zero1: also shard it over the data axes "
        "(and the context axis, which sums the same gradients).",
    )
    pipeline: PipelineConfig | None = Field(
        default=None, description="Pipeline stages (needs a mesh axis named by `axis`)."
    )
    experts: ExpertsConfig | None = Field(
        default=None,
        description="Expert parallelism for mixture-of-experts "
        "blocks: which modules, over which axis, how tokens are dispatched.",
    )
    context: ContextConfig | None = Field(
        default=None,
        description="Context parallelism: the sequence split over "
        "a mesh axis, with attention across it (docs/context.md).",
    )
    activations: list[ActivationRule] = Field(
        default_factory=list,
        description="Ordered rules from module paths to the spec of the module's output, "
        "applied as sharding constraints; the first full match wins.",
    )
    remat: list[RematRule] = Field(
        default_factory=list,
        description="Ordered rules from module paths to a rematerialisation policy; the first full match wins.",
    )
    precision: Precision = Field(default_factory=Precision, description="Parameter and compute dtypes.")
    accumulate: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Gradient accumulation: microbatches each step's batch is split into "
        "when there is no pipeline. `shardplan.model_loss` runs forward and backward on one microbatch after another "
        "and sums their gradients, so activations are one microbatch's; the loss must be a mean over rows. A "
        "pipeline splits the batch itself (`pipeline.microbatches`).",
    )
    tensor_overlap: bool = Field(
        default=False,
        description="Collective matmul on GPUs: XLA splits the tensor axes' all-gathers and "
        "reduce-scatters beside a matmul (the layouts of sequence parallelism, as Megatron's `--tp-comm-overlap` "
        "needs `--sequence-parallel`) into a ring of pieces that run while the matmul's parts compute (windowed "
        "einsum). Set by `shardplan.set_performance_flags(plan)` before JAX starts; on CPU and TPU it does nothing "
        "and says so.",
    )
    logical_axes: dict[AxisName, Union[None, AxisName, list[AxisName]]] = Field(
        default_factory=dict,
        description="Logical dim name -> the mesh axis (or list of axes, or null: not split) it "
        "stands for. Specs in params, inputs and activations may use the logical names; moving a plan from tensor "
        "parallel to FSDP is then one line here.",
    )
    logical_rules: list[
        Annotated[
            tuple[AxisName, Union[None, AxisName, list[AxisName]]],
            BeforeValidator(lambda pair: tuple(pair) if isinstance(pair, list) else pair),
        ]
    ] = Field(
        default_factory=list,
        description="Instead of logical_axes: ordered [logical name, mesh axes] pairs resolved "
        "per array as flax.linen.logical_to_mesh_axes does (MaxText's logical_axis_rules): a rule is taken for its "
        "name's dim only if none of its axes is already taken by another dim of that array, else a later rule for "
        "the same name is tried; a name no rule takes is not split.",
    )

    @model_validator(mode="after")
    def _resolve_logical_axes(self) -> "Plan":
        """Specs in logical names become specs in mesh axes; the originals stay for `explain`."""
        if not self.logical_axes and not self.logical_rules:
            return self
        if self.logical_axes and self.logical_rules:
            raise ValueError(
                "give logical_axes (one mesh axis per name) or logical_rules (ordered, with flax's "
                "per-array fallbacks), not both"
            )
        clash = [name for name in self.logical_axes if name in self.mesh.axes]
        if clash:
            raise ValueError(
                f"logical axis {clash[0]!r} is also a mesh axis name; give logical names of their own "
                "(e.g. embed, heads, mlp, vocab)"
            )
        written = {}
        for section in ("params", "activations"):
            rules = getattr(self, section)
            for k, rule in enumerate(rules):
                resolved = self.resolve_logical(rule.spec)
                if resolved != rule.spec:
                    written[(section, k)] = rule.spec
            object.__setattr__(
                self, section, [rule.model_copy(update={"spec": self.resolve_logical(rule.spec)}) for rule in rules]
            )
        inputs = {}
        for name, raw in self.inputs.items():
            spec = self.resolve_logical(input_spec(raw))
            if spec != input_spec(raw):
                written[("inputs", name)] = input_spec(raw)
            inputs[name] = raw.model_copy(update={"spec": spec}) if isinstance(raw, InputSpec) else spec
        object.__setattr__(self, "inputs", inputs)
        self._written = written
        return self

    def resolve_logical(self, spec):
        """A spec with its logical names replaced by the mesh axes `logical_axes` (or `logical_rules`) gives them."""
        if spec in ("replicated", "annotated") or not (self.logical_axes or self.logical_rules):
            return spec
        if self.logical_rules:
            from shardplan.plan.logical import resolve

            entries = [None if entry == UNSHARDED else entry for entry in spec]
            return resolve(entries, self.logical_rules, self.mesh.axes)[0]
        out = []
        for entry in spec:
            names = [entry] if isinstance(entry, str) else list(entry or [])
            axes = []
            for name in names:
                target = self.logical_axes.get(name, name) if name != UNSHARDED else None
                axes += [] if target is None else [target] if isinstance(target, str) else list(target)
            out.append(entry if entry is None else None if not axes else axes[0] if len(axes) == 1 else axes)
        return out

    def written_spec(self, section: str, key) -> list | None:
        """The spec as written in logical names, where `logical_axes` rewrote it (for `explain`)."""
        return self._written.get((section, key))

    def written_specs(self) -> list[tuple[tuple[str, Any], list]]:
        """((section, rule index or input name), spec as written) of every spec logical names rewrote."""
        return list(self._written.items())

    _written: dict = PrivateAttr(default_factory=dict)

    @field_validator("inputs", mode="before")
    @classmethod
    def _input_specs(cls, inputs: Any) -> Any:
        if isinstance(inputs, dict):
            for spec in inputs.values():
                if not isinstance(spec, dict):
                    check_spec_shape(spec, allow_replicated=False)
        return inputs

    @property
    def input_specs(self) -> dict[str, NormalSpec]:
        """Input name -> its spec as per-dim axis tuples (`normalize_spec`)."""
        return {name: normalize_spec(raw) for name, raw in self.inputs.items()}

    def example_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Input name -> shape of the example batch, for the inputs that give one; None if none does."""
        return {name: found[0] for name, raw in self.inputs.items() if (found := input_example(raw))} or None

    _file: str | None = PrivateAttr(default=None)
    _positions: dict[tuple, tuple[int, int]] = PrivateAttr(default_factory=dict)

    @property
    def file(self) -> str | None:
        return self._file

    def locate(self, *keys: str | int) -> tuple[int | None, int | None]:
        """(line, column) of the longest known prefix of `keys`, or (None, None)."""
        for end in range(len(keys), -1, -1):
            if keys[:end] in self._positions:
                return self._positions[keys[:end]]
        return None, None

    def with_source(self, file: str | None, positions: dict[tuple, tuple[int, int]]) -> "Plan":
        self._file = file
        self._positions = dict(positions)
        return self


def check_spec_shape(spec: Any, *, allow_replicated: bool) -> Any:
    """One clear message for a malformed spec instead of one per union member."""
    if allow_replicated and spec == "replicated":
        return spec
    expected = "a list of entries (null, '_', an axis name, or a list of axis names)" + (
        " or 'replicated'" if allow_replicated else ""
    )
    if not isinstance(spec, list):
        raise ValueError(f"a spec must be {expected}, but got {spec!r}")
    for entry in spec:
        nested_ok = isinstance(entry, list) and all(isinstance(a, str) for a in entry)
        if not (entry is None or isinstance(entry, str) or nested_ok):
            raise ValueError(f"spec entries must be null, '_', an axis name or a list of axis names, but got {entry!r}")
    return spec


NormalSpec = tuple[tuple[str, ...] | None, ...]  # per dim: the axes that split it, or None


def normalize_spec(spec: "str | list[SpecEntry] | InputSpec") -> NormalSpec:
    """Spec as a tuple of per-dim axis tuples (None: not sharded).

    >>> normalize_spec([None, "model", ["data", "model"], "_"])
    (None, ('model',), ('data', 'model'), None)
    >>> normalize_spec("replicated")
    ()
    """
    spec = input_spec(spec)
    if spec in ("replicated", "annotated"):
        return ()
    return tuple(_normalize_entry(entry) for entry in spec)


def _normalize_entry(entry: SpecEntry) -> tuple[str, ...] | None:
    if entry is None or entry == UNSHARDED:
        return None
    if isinstance(entry, str):
        return (entry,)
    axes = tuple(a for a in entry if a != UNSHARDED)
    return axes or None


def spec_axes(spec: tuple[tuple[str, ...] | None, ...]) -> list[str]:
    return [axis for entry in spec if entry for axis in entry]


def format_spec(spec: tuple[tuple[str, ...] | None, ...]) -> str:
    """Human form in PartitionSpec notation: `P(None, 'model')`; `replicated` for no sharding."""
    if not any(spec):
        return "replicated"
    parts = []
    for entry in spec:
        if entry is None:
            parts.append("None")
        elif len(entry) == 1:
            parts.append(repr(entry[0]))
        else:
            parts.append("(" + ", ".join(repr(a) for a in entry) + ")")
    return "P(" + ", ".join(parts) + ")"
