"""What each parameter does, read from the model's structure and shapes alone: pure.

No model is named here. The residual width is the most common size of the model's vector
parameters (norm scales, biases). A matrix that reads the residual stream (its input dims are
exactly (width,)) opens a tensor-parallel group as *column* (its outputs split); the matrix that
writes the stream back closes it as *row* (its inputs split). A square (width, width) matrix
does either: it closes an open group only if it is the last matrix among its siblings (the
`wo` after `wq, wk, wv`). That is why definition order matters, and why the order is read from
the live module rather than from the sorted state.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import weakref
import re

from shardplan.core.paths import ParamInfo

EMBEDDING, COLUMN, ROW, MATMUL, BIAS, VECTOR = "embedding", "column", "row", "matmul", "bias", "vector"
# Head size assumed when a model keeps heads flattened into one dim (only attention-score bytes use it).
ASSUMED_HEAD_DIM = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Role:
    path: str
    kind: str  # one of EMBEDDING, COLUMN, ROW, MATMUL (other matrices), BIAS, VECTOR
    in_dims: tuple[int, ...]  # dims contracted with the incoming activation (matrices only)
    out_dims: tuple[int, ...]  # dims of the produced activation, the one to split first first (matrices;
    #                             a bias: its own dims)
    owner: str | None = None  # a bias: the path of its matrix
    closes: bool = False  # a column matrix whose group a row matrix closes (False: e.g. the output head)
    group: int | None = None  # column and row matrices of one tensor-parallel group share it


@dataclasses.dataclass(frozen=True, slots=True)
class Attention:
    """A group of three or more column matrices reading one input: queries, keys, values."""

    layer: int | None
    width: int  # query output size (heads x head size)
    heads: int
    members: tuple[str, ...] = ()  # the matrices' paths: the queries' first, then keys and values


@dataclasses.dataclass(frozen=True, slots=True)
class CodeCopies:
    """What the model's code keeps for the backward beyond a plain transformer's, which the parameters
    do not show (`shardplan.planner.kept.traced_copies`; never fewer: the plain constants stay a floor)."""

    scores: float = 0.0  # of each attention layer's float32 scores
    logits: float = 0.0  # of the float32 logits
    head_weights: float = 0.0  # of the output head's weights (a tied head's transpose)
    heads: float = 1.0  # the scores' heads per head `Attention` counts (which guesses flattened ones)
    top_k: int = 0  # experts each token's rows go to in the MoE blocks (0: none seen)
    traced: bool = False  # read from the code (False: a plain transformer's assumed)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRoles:
    width: int  # residual-stream width
    roles: dict[str, Role]
    order: tuple[str, ...]  # parameter paths in definition order
    layers: str | None  # top-level attribute holding the repeated layers, if any
    layer_count: int
    attention: tuple[Attention, ...]
    after_layers: frozenset[str]  # parameters defined after the repeated layers (the 1F1B head)
    tied: frozenset[str] = frozenset()  # embeddings that are also the output head (no head matrix of its own)
    code: CodeCopies = CodeCopies()  # read from the model's code, not its parameters (default: a plain one's)

    @property
    def modules(self) -> list[str]:
        return top_level(self.order)

    def of(self, path: str) -> Role:
        return self.roles[path]

    def layer_of(self, path: str) -> int | None:
        return _layer_index(self.layers, path)


# The definition order of abstract models shardplan built (`shardplan.model.abstract.eval_shape`), read
# while they were being built: `nnx.eval_shape` returns them with their attributes sorted by name.
_BUILT_ORDER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_order(module, order: list[str]) -> None:
    """Keep `order`, read from `module` while it was built, for the abstract copy `module` is now."""
    _BUILT_ORDER[module] = list(order)


def order_lost(module) -> bool:
    """Whether `module` is an abstract model whose definition order is gone: one from the user's own
    `nnx.eval_shape` (its state sorted by name), not one shardplan built (`remember_order`)."""
    import jax
    from flax import nnx

    if module in _BUILT_ORDER:
        return False
    return any(
        isinstance(v.get_value(), jax.ShapeDtypeStruct) for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)
    )


def definition_order(module) -> list[str]:
    """Parameter paths of a live module in the order its attributes were set; of an abstract model
    shardplan built, the order read while it was built.

    (The state of an abstract model from `nnx.eval_shape` is sorted by name instead.)
    """
    from flax import nnx

    if module in _BUILT_ORDER:
        return list(_BUILT_ORDER[module])

    paths: list[str] = []

    def walk(node, prefix: str) -> None:
        if isinstance(node, nnx.Param):
            paths.append(prefix)
        elif isinstance(node, nnx.Variable):
            return
        elif isinstance(node, (nnx.Module, nnx.Pytree)):
            for name, value in vars(node).items():
                if not name.startswith("_"):
                    walk(value, f"{prefix}/{name}" if prefix else name)
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{prefix}/{i}")
        elif isinstance(node, dict):
            for name, value in node.items():
                walk(value, f"{prefix}/{name}")

    walk(module, "")
    return paths


def residual_width(params: list[ParamInfo]) -> int:
    """The most common size among 1-D parameters (norm scales, biases); ties go to the larger."""
    sizes = collections.Counter(p.shape[0] for p in params if len(p.shape) == 1)
    if not sizes:
        sizes = collections.Counter(d for p in params for d in p.shape)
    return max(sizes, key=lambda n: (sizes[n], n)) if sizes else 0


def split_dims(shape: tuple[int, ...], width: int, leaf: str = "kernel") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(in dims, out dims) of a matrix. Flax keeps a `kernel` (Linear, LinearGeneral, Conv) as
    in_features + out_features. Einsum weights under other names may store heads first, the residual
    width in the middle: `(heads, embed, head_dim)` reads the stream at dim 1, a fused
    `(2, kv_heads, embed, head_dim)` at dim 2; the dim to split for tensor parallelism is then the
    last one before the width (the heads; a leading 2 is a key/value or gate/up stack), or the first
    after it for a stack over a dim wider than the stream (`(2, embed, hidden)`, gate and up).

    >>> split_dims((256, 8, 32), 256), split_dims((8, 32, 256), 256), split_dims((3, 3, 3, 16), 32)
    (((0,), (1, 2)), ((0, 1), (2,)), ((0, 1, 2), (3,)))
    >>> split_dims((8, 256, 32), 256, "w"), split_dims((2, 4, 256, 32), 256, "w"), split_dims((2, 256, 1024), 256, "w")
    (((1,), (0, 2)), ((2,), (1, 0, 3)), ((1,), (2, 0)))
    """
    n = len(shape)
    if n > 2 and shape[0] == width and shape[-1] != width:
        return (0,), tuple(range(1, n))
    reading = [d for d in range(1, n - 1) if shape[d] == width]
    if leaf != "kernel" and shape[-1] != width and len(reading) == 1:
        at = reading[0]
        before, after = list(range(at)), list(range(at + 1, n))
        stacked = shape[0] == 2 and (len(before) > 1 or shape[after[0]] > width)
        heads = before[1:] if stacked else before
        first = heads[-1] if heads else after[0]
        return (at,), (first, *[d for d in before + after if d != first])
    return tuple(range(n - 1)), (n - 1,)


def recognise(params: list[ParamInfo], order: list[str] | None = None) -> ModelRoles:
    """Roles of every parameter; `order` is `definition_order(model)` (default: path order).

    Reads only `.path` and `.shape`, so a report's `ParamLayout`s serve as well as `ParamInfo`s.
    """
    by_path = {p.path: p for p in params}
    order = [path for path in (order or []) if path in by_path] or sorted(by_path)
    listed = set(order)
    order += [path for path in sorted(by_path) if path not in listed]
    width = residual_width(params)
    layers, layer_count = _repeated_layers(order, by_path)
    matrices = [path for path in order if len(by_path[path].shape) >= 2 and not path.endswith(("/bias", "embedding"))]
    # A square matrix closes a group only as the last matrix among its siblings (wq, wk, wv, wo).
    last_sibling = {_parent(_parent(path)): path for path in matrices}
    roles: dict[str, Role] = {}
    open_group: list[str] = []  # column matrices waiting for their row matrix
    open_parent = None
    groups = 0
    for path in order:
        info = by_path[path]
        leaf = path.rsplit("/", 1)[-1]
        if len(info.shape) < 2 or leaf == "bias":
            continue
        if leaf == "embedding":
            roles[path] = Role(path, EMBEDDING, (0,), (len(info.shape) - 1,))
            continue
        in_dims, out_dims = split_dims(info.shape, width, leaf)
        reads = tuple(info.shape[d] for d in in_dims) == (width,)
        writes = tuple(info.shape[d] for d in out_dims) == (width,)
        layer_changed = _layer_prefix(path, layers) != _layer_prefix(open_parent or "", layers)
        if open_group and layer_changed:
            open_group = []
        closing = writes and (not reads or path == last_sibling[_parent(_parent(path))])
        if closing and (open_group or not reads):
            kind = ROW if open_group else MATMUL
            for column in open_group:
                roles[column] = dataclasses.replace(roles[column], closes=True)
            group = roles[open_group[0]].group if open_group else None
            open_group = []
        elif reads:
            kind = COLUMN
            group = roles[open_group[0]].group if open_group else groups
            groups += not open_group
            open_group.append(path)
            open_parent = path
        else:
            kind, group = MATMUL, None
        roles[path] = Role(path, kind, in_dims, out_dims, group=group)
    owners: dict[str, list[str]] = {}  # a module's matrices, in definition order
    for other, role in roles.items():
        if role.kind in (COLUMN, ROW, MATMUL):
            owners.setdefault(_parent(other), []).append(other)
    for path in order:
        info = by_path[path]
        if path in roles:
            continue
        owner = _bias_owner(path, info, roles, by_path, owners.get(_parent(path), []))
        if owner is not None:
            roles[path] = Role(path, BIAS, (), tuple(range(len(info.shape))), owner=owner)
        else:
            roles[path] = Role(path, VECTOR, (), tuple(range(len(info.shape))))
    attention = _attention(order, roles, by_path, layers)
    # A language model without a head matrix (a column matrix that no row matrix closes) computes its
    # logits from its embedding: the embedding is used twice, and its gradient reduced twice.
    has_head = any(r.kind == COLUMN and not r.closes for r in roles.values())
    tied = (
        frozenset()
        if has_head
        else frozenset(p for p, r in roles.items() if r.kind == EMBEDDING and by_path[p].shape[0] > width)
    )
    return ModelRoles(width, roles, tuple(order), layers, layer_count, attention, _after(order, layers), tied)


def recognise_module(module) -> ModelRoles:
    """`recognise` for a live module (its definition order is still there)."""
    from shardplan.core.paths import param_infos

    return recognise(param_infos(module), definition_order(module))


def top_level(order) -> list[str]:
    """Top-level attributes holding parameters, in the order of `order`."""
    return list(dict.fromkeys(path.split("/", 1)[0] for path in order))


def _after(order: list[str], layers: str | None) -> frozenset[str]:
    if layers is None:
        return frozenset()
    last = max((i for i, path in enumerate(order) if _layer_index(layers, path) is not None), default=len(order))
    return frozenset(order[last + 1 :])


@functools.lru_cache(maxsize=1 << 16)
def _layer_index(layers: str | None, path: str) -> int | None:
    if layers is None:
        return None
    found = re.match(rf"{re.escape(layers)}/(\d+)/", path)
    return int(found.group(1)) if found else None


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _layer_prefix(path: str, layers: str | None) -> str:
    if layers is None:
        return ""
    found = re.match(rf"({re.escape(layers)}/\d+)/", path)
    return found.group(1) if found else ""


def _bias_owner(
    path: str, info: ParamInfo, roles: dict[str, Role], by_path: dict[str, ParamInfo], siblings: list[str]
) -> str | None:
    """The matrix in the same module (`siblings`) whose output dims this parameter's shape equals."""
    for other in siblings:
        if tuple(by_path[other].shape[d] for d in roles[other].out_dims) == info.shape:
            return other
    return None


def _repeated_layers(order: list[str], by_path: dict[str, ParamInfo]) -> tuple[str | None, int]:
    """The top-level attribute whose children 0..n-1 share one parameter structure, n >= 2."""
    structure: dict[str, dict[int, set]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for path in order:
        found = re.match(r"([^/]+)/(\d+)/(.+)$", path)
        if found:
            structure[found.group(1)][int(found.group(2))].add((found.group(3), by_path[path].shape))
    best, count = None, 0
    for name, children in structure.items():
        shapes = list(children.values())
        if (
            len(children) >= 2
            and sorted(children) == list(range(len(children)))
            and all(s == shapes[0] for s in shapes)
            and len(children) > count
        ):
            best, count = name, len(children)
    return best, count


def _attention(order, roles, by_path, layers) -> tuple[Attention, ...]:
    found = []
    groups: dict[int, list[str]] = collections.defaultdict(list)
    for path in order:
        role = roles[path]
        if role.kind == COLUMN and role.closes:
            groups[role.group].append(path)
    for members in groups.values():
        prefix = _layer_prefix(members[0], layers)
        # queries, keys and values: three matrices, or fewer with heads kept in a dim of their own
        # (a fused key/value einsum)
        if len(members) >= 3 or (len(members) == 2 and all(len(roles[m].out_dims) > 1 for m in members)):
            query = by_path[members[0]]
            out = [query.shape[d] for d in roles[members[0]].out_dims]
            width = math.prod(out)
            heads = out[0] if len(out) > 1 else max(1, width // ASSUMED_HEAD_DIM)
            layer = int(prefix.rsplit("/", 1)[-1]) if prefix else None
            found.append(Attention(layer, width, heads, tuple(members)))
    return tuple(found)
