"""Blocks that run every expert on every token and weigh the results by the router's (mostly zero)
weights: a loop over `w[i]`, or einsums over the expert dim. Run expert-parallel, they compute each
expert only on the tokens routed to it, with the same operations in the same order.

A product of tokens with an expert weight becomes a `Lazy` value: the tokens and the expression the
block builds on them (matmuls with expert weights, element-wise operations), not yet computed, with
each dim labelled (token dims `T0, T1, ...`, the expert dim `E`, the feature dim `F`). When the block
multiplies it by a gate (a value that does not depend on the experts, zero for the pairs it does not
route), the routed (token, expert) pairs are known; when it then sums over the experts, the pairs'
token rows go to the devices owning their experts, the expression runs there, and the results come
back summed per token (`materialise`). The terms of a loop over experts (`out = out + gate_i *
expert_i(x)`), whose expressions are the same for every i, run as one exchange.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from shardplan.experts import exchange


class DenseFormError(Exception):
    """What `interpret` reports as a contract error."""


@dataclasses.dataclass(frozen=True)
class ExpertSlice:
    """One expert's weight, `stack[index]`, indexed by the block's own code."""

    stack: jax.Array  # this device's experts
    key: object  # the stack's variable (identity)
    index: int
    experts: int  # E
    keepdim: bool


@dataclasses.dataclass(frozen=True)
class Stack:
    """An expert weight stack as an operand: this device's experts, the variable, E."""

    value: jax.Array
    key: object
    experts: int


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One operation of a lazy expression, on rows (one per routed pair)."""

    op: str  # tokens | gate | matmul | row
    args: tuple = ()  # child nodes, or scalars for `row`
    weight: jax.Array | None = None
    key: object = None
    contract: int = 1  # the stack's contracted dim
    params: tuple = ()
    prim: object = None

    def signature(self, memo=None) -> tuple:
        memo = {} if memo is None else memo
        if id(self) not in memo:
            args = tuple(a.signature(memo) if isinstance(a, Node) else ("scalar",) for a in self.args)
            memo[id(self)] = (self.op, args, id(self.key), self.contract, self.params, getattr(self.prim, "name", None))
        return memo[id(self)]


@dataclasses.dataclass(frozen=True)
class Lazy:
    """A per-(token, expert) value not computed yet; `labels` name its dims in the block's program."""

    node: Node
    labels: tuple  # e.g. ('T0', 'T1', 'E', 'F')
    tokens: jax.Array  # (N, D) the block's token rows; (E, N, D) when each expert reads its own copy
    token_shape: tuple
    experts: int
    expert: int | None  # a fixed expert (a loop's term), else every expert (an 'E' label)
    width: int  # the feature dim
    gate: jax.Array | None = None  # (N, E), or (N,) for a fixed expert
    per_expert: bool = False  # tokens are (E, N, D): expert e reads tokens[e]
    # The 'E' dim counts each token's chosen experts (k of them), not all E: the pair (n, j) is expert
    # choices[n, j] (its matrices gathered per token by the block's code, `Picked`).
    choices: jax.Array | None = None
    origin: object = None  # the index array the choices were gathered by

    def signature(self):
        return self.node.signature(), self.width, self.labels

    def with_node(self, node: Node, labels=None, width=None) -> "Lazy":
        return dataclasses.replace(self, node=node, labels=labels or self.labels, width=width or self.width)


@dataclasses.dataclass(frozen=True)
class LazySum:
    """A home value plus gated terms of one expert each (a loop over experts), summed when read."""

    home: jax.Array | None
    terms: tuple


@dataclasses.dataclass(frozen=True)
class Picked:
    """`jnp.take(w, idx, axis=0)`: each token's chosen experts' whole matrices, [N..., k, ...], gathered by
    the block's own code; not computed (the matrices stay with their experts)."""

    stack: jax.Array  # this device's experts
    key: object
    choices: jax.Array  # (N..., k) expert ids
    experts: int
    origin: object  # the index array, as the block's code passed it


def is_lazy(x) -> bool:
    return isinstance(x, (Lazy, LazySum, ExpertSlice, Picked))


def picked(eqn, stack, key, indices, origin) -> Picked:
    """A gather of whole expert matrices by an index array (what `jnp.take(w, idx, axis=0)` lowers to)."""
    numbers, aval = eqn.params["dimension_numbers"], eqn.invars[0].aval
    rank = indices.ndim - 1
    if (
        tuple(numbers.collapsed_slice_dims) != (0,)
        or tuple(numbers.start_index_map) != (0,)
        or numbers.operand_batching_dims
        or indices.shape[-1] != 1
        or rank != 2
        or tuple(numbers.offset_dims) != tuple(range(rank, rank + aval.ndim - 1))
        or tuple(eqn.params["slice_sizes"]) != (1, *aval.shape[1:])
        or aval.ndim != 3
    ):
        raise DenseFormError(
            "an expert weight gathered other than whole matrices by a [tokens, k] index array "
            "(jnp.take(w, top_k, axis=0))"
        )
    return Picked(stack, key, indices[..., 0], aval.shape[0], origin)


def expert_slice(params: dict, stack, key, aval) -> ExpertSlice:
    start, limit = params["start_indices"], params["limit_indices"]
    strides = params.get("strides") or (1,) * len(start)
    if (
        limit[0] - start[0] == 1
        and all(s == 0 and stop == d for s, stop, d in zip(start[1:], limit[1:], aval.shape[1:]))
        and all(s == 1 for s in strides)
    ):
        return ExpertSlice(stack, key, int(start[0]), aval.shape[0], keepdim=True)
    raise DenseFormError("an expert weight is sliced other than as one whole expert `w[i]`")


def squeeze(x: ExpertSlice, dims) -> ExpertSlice:
    if not x.keepdim or tuple(dims) != (0,):
        raise DenseFormError("an indexed expert weight reshaped other than by dropping its expert dim")
    return dataclasses.replace(x, keepdim=False)


def _dot_labels(lhs: tuple, rhs: tuple, lc, rc, lb, rb) -> tuple:
    """Labels of a dot_general's output: batch dims (lhs order), lhs free dims, rhs free dims."""
    batch = tuple(lhs[d] for d in lb)
    return (
        batch
        + tuple(label for d, label in enumerate(lhs) if d not in lc and d not in lb)
        + tuple(label for d, label in enumerate(rhs) if d not in rc and d not in rb)
    )


def dot(eqn, lhs, rhs, ex):
    """A dot_general with an expert weight or a lazy value among its operands (either side)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    dims = tuple(lc), tuple(rc), tuple(lb), tuple(rb)
    params = (
        ("precision", eqn.params.get("precision")),
        ("preferred_element_type", eqn.params.get("preferred_element_type")),
    )
    avals = eqn.invars[0].aval, eqn.invars[1].aval
    weights = (ExpertSlice, Stack)
    for flip in (False, True):
        a, b = (rhs, lhs) if flip else (lhs, rhs)
        (ac, bc, ab, bb) = (dims[1], dims[0], dims[3], dims[2]) if flip else dims
        a_aval, b_aval = (avals[1], avals[0]) if flip else avals
        out = None
        if isinstance(b, Picked) and not is_lazy(a) and not isinstance(a, weights):
            out = _start_picked(a, b, ac, bc, ab, bb, a_aval, params, flip, ex)
        elif isinstance(b, Picked) and isinstance(a, Lazy):
            out = _matmul_picked(a, b, ac, bc, ab, bb, params, flip)
        elif isinstance(b, weights) and not is_lazy(a) and not isinstance(a, weights):
            out = _start(a, b, ac, bc, ab, bb, a_aval, params, flip, ex)
        elif isinstance(a, Lazy) and isinstance(b, weights):
            out = _matmul(a, b, ac, bc, ab, bb, params, flip, ex)
        elif isinstance(a, Lazy) and not is_lazy(b) and not isinstance(b, weights):
            out = _gate_by_dot(a, b, ac, bc, ab, bb, b_aval, flip, ex)
        if out is not None:
            return out
    raise DenseFormError("a dot_general of expert outputs this block form does not allow (docs/experts.md)")


def _order(labels_a, labels_b, ac, bc, ab, bb, flip):
    return _dot_labels(labels_b, labels_a, bc, ac, bb, ab) if flip else _dot_labels(labels_a, labels_b, ac, bc, ab, bb)


def _start(x, w, xc, wc, xb, wb, x_aval, params, flip, ex):
    if xb or wb or xc != (x_aval.ndim - 1,):
        raise DenseFormError("tokens times an expert weight other than over the tokens' last dim")
    # One row array per token array, so that expressions on the same tokens are known to be (`row`).
    kept = ex.token_rows.setdefault(id(x), (x, x.reshape(-1, x.shape[-1])))
    tokens = kept[1]
    token_labels = tuple(f"T{k}" for k in range(x_aval.ndim - 1))
    source = Node("tokens")
    if isinstance(w, ExpertSlice):
        if w.keepdim or wc not in ((0,), (1,)):
            raise DenseFormError("an indexed expert weight used other than as a [K, N] or [N, K] matrix")
        node = Node("matmul", (source,), w.stack, w.key, contract=wc[0] + 1, params=params)
        labels = _order(token_labels + ("K",), ("K", "F") if wc == (0,) else ("F", "K"), xc, wc, xb, wb, flip)
        return Lazy(node, labels, tokens, tuple(x_aval.shape[:-1]), w.experts, w.index, w.stack.shape[3 - (wc[0] + 1)])
    if wc not in ((1,), (2,)):
        raise DenseFormError("tokens times an expert stack other than [E, K, N] or [E, N, K]")
    node = Node("matmul", (source,), w.value, w.key, contract=wc[0], params=params)
    labels = _order(token_labels + ("K",), ("E", "K", "F") if wc == (1,) else ("E", "F", "K"), xc, wc, xb, wb, flip)
    return Lazy(node, labels, tokens, tuple(x_aval.shape[:-1]), w.experts, None, w.value.shape[3 - wc[0]])


def _picked_labels(p: Picked, contract: int) -> tuple:
    """Labels of a `Picked` value [T0, 'E' (the choices), matrix dims] with its contracted dim 'K'."""
    return ("T0", "E") + (("K", "F") if contract == 1 else ("F", "K"))


def _start_picked(x, p: Picked, xc, pc, xb, pb, x_aval, params, flip, ex):
    """Tokens [N, D] times their chosen experts' matrices [N, k, F, D] (the token dim a batch dim)."""
    if tuple(xb) != (0,) or tuple(pb) != (0,) or xc != (1,) or x_aval.ndim != 2 or pc[0] not in (2, 3):
        raise DenseFormError("tokens times their gathered expert matrices other than [N, D] x [N, k, ...] over D")
    contract = pc[0] - 1
    kept = ex.token_rows.setdefault(id(x), (x, x))
    node = Node("matmul", (Node("tokens"),), p.stack, p.key, contract=contract, params=params)
    labels = _order(("T0", "K"), _picked_labels(p, contract), xc, pc, xb, pb, flip)
    return Lazy(
        node,
        labels,
        kept[1],
        (x_aval.shape[0],),
        p.experts,
        None,
        p.stack.shape[3 - contract],
        choices=p.choices,
        origin=p.origin,
    )


def _matmul_picked(x: Lazy, p: Picked, xc, pc, xb, pb, params, flip):
    """Expert outputs per (token, choice) times the same choices' gathered matrices."""
    if x.choices is None or p.origin is not x.origin or x.gate is not None:
        raise DenseFormError("expert outputs times expert matrices gathered by other indices")
    f, e, t = x.labels.index("F"), x.labels.index("E"), x.labels.index("T0")
    pairs, batch = dict(zip(xc, pc)), dict(zip(xb, pb))
    if batch != {t: 0, e: 1} or set(pairs) != {f} or pairs[f] not in (2, 3):
        raise DenseFormError(
            "expert outputs times their gathered matrices other than per (token, choice) over the features"
        )
    contract = pairs[f] - 1
    node = Node("matmul", (x.node,), p.stack, p.key, contract=contract, params=params)
    x_labels = x.labels[:f] + ("K",) + x.labels[f + 1 :]
    return x.with_node(
        node, _order(x_labels, _picked_labels(p, contract), xc, pc, xb, pb, flip), p.stack.shape[3 - contract]
    )


def _pair_gate(x: Lazy, gate):
    """The router's weights per (token, 'E' index) as (N, E): for gathered choices, scattered to their experts."""
    if x.choices is None:
        return gate
    rows = jnp.arange(gate.shape[0])[:, None]
    return jnp.zeros((gate.shape[0], x.experts), gate.dtype).at[rows, x.choices.reshape(gate.shape[0], -1)].add(gate)


def _matmul(x: Lazy, w, xc, wc, xb, wb, params, flip, ex):
    if x.choices is not None:
        raise DenseFormError("expert outputs of gathered matrices times a whole expert stack")
    f = x.labels.index("F")
    if isinstance(w, ExpertSlice):
        if x.expert != w.index or w.keepdim or xb or xc != (f,) or wc not in ((0,), (1,)):
            raise DenseFormError("an expert's output times another expert's weight")
        node = Node("matmul", (x.node,), w.stack, w.key, contract=wc[0] + 1, params=params)
        labels = _order(
            x.labels[:f] + ("K",) + x.labels[f + 1 :], ("K", "F") if wc == (0,) else ("F", "K"), xc, wc, xb, wb, flip
        )
        return x.with_node(node, labels, w.stack.shape[3 - (wc[0] + 1)])
    if "E" not in x.labels:
        raise DenseFormError("expert outputs times an expert stack other than expert by expert")
    e = x.labels.index("E")
    pairs, batch = dict(zip(xc, wc)), dict(zip(xb, wb))
    contract = pairs.get(f)
    if contract not in (1, 2):
        raise DenseFormError("expert outputs times an expert stack other than over their features")
    node = Node("matmul", (x.node,), w.value, w.key, contract=contract, params=params)
    width = w.value.shape[3 - contract]
    stack_labels = ("E", "K", "F") if contract == 1 else ("E", "F", "K")
    x_labels = x.labels[:f] + ("K",) + x.labels[f + 1 :]
    out_labels = _order(x_labels, stack_labels, xc, wc, xb, wb, flip)
    if batch == {e: 0} and set(pairs) == {f}:  # expert by expert: still per pair
        return x.with_node(node, out_labels, width)
    if not batch and set(pairs) == {e, f} and pairs[e] == 0 and x.gate is not None:
        summed = x.with_node(node, tuple(label for label in x.labels if label not in ("E", "F")) + ("F",), width)
        return _arranged(materialise(summed, ex), summed, out_labels)  # and summed over the experts
    raise DenseFormError("expert outputs summed over the experts before the router's weights apply")


def _gate_by_dot(x: Lazy, g, xc, gc, xb, gb, g_aval, flip, ex):
    """Expert outputs times the router's weights [tokens..., E]: as batch dims (a product per pair), or
    with E contracted (the weighted sum)."""
    if x.expert is not None or x.gate is not None or "E" not in x.labels:
        raise DenseFormError("expert outputs times a value that is not the router's weights [tokens..., E]")
    pairs = dict(zip(xb, gb)) | dict(zip(xc, gc))
    names = {pairs[d]: x.labels[d] for d in pairs}
    wanted = tuple(f"T{k}" for k in range(len(x.token_shape))) + ("E",)
    if sorted(names.values()) != sorted(wanted) or len(names) != g_aval.ndim:
        raise DenseFormError("expert outputs times a value that is not the router's weights [tokens..., E]")
    order = [next(d for d, n in names.items() if n == label) for label in wanted]
    gate = _pair_gate(x, jnp.transpose(g, order).reshape(x.tokens.shape[-2], -1))
    gated = dataclasses.replace(x, gate=gate, node=Node("gate", (x.node,)))
    e = x.labels.index("E")
    out_labels = _order(x.labels, tuple(names[d] for d in range(g_aval.ndim)), xc, gc, xb, gb, flip)
    if e in xb and not xc:
        return gated.with_node(gated.node, out_labels)
    if tuple(xc) == (e,):
        summed = gated.with_node(gated.node, tuple(label for label in x.labels if label != "E"))
        return _arranged(materialise(summed, ex), summed, out_labels)
    raise DenseFormError("expert outputs times the router's weights in a layout this form does not allow")


def gate_by_mul(x: Lazy, g_source) -> Lazy:
    """`x * g` where g was broadcast along the features from the router's weights: (operand, dims)."""
    if x.gate is not None or g_source is None:
        raise DenseFormError(
            "expert outputs multiplied by a value that is not the router's weights broadcast along the features"
        )
    operand, dims = g_source
    labels = [x.labels[d] for d in dims]
    if any(label == "F" and operand.shape[k] != 1 for k, label in enumerate(labels)):
        raise DenseFormError("expert outputs multiplied by a value that varies along their features")
    kept = [(label, k) for k, label in enumerate(labels) if label != "F"]
    value = jnp.squeeze(operand, [k for k, label in enumerate(labels) if label == "F"])
    wanted = tuple(f"T{k}" for k in range(len(x.token_shape))) + (("E",) if x.expert is None else ())
    if sorted(label for label, _ in kept) != sorted(wanted):
        raise DenseFormError("expert outputs multiplied by a value that is not the router's weights [tokens..., E]")
    order = [next(i for i, (label, _) in enumerate(kept) if label == w) for w in wanted]
    gate = jnp.transpose(value, order).reshape(x.tokens.shape[-2], -1)
    gate = gate[:, 0] if x.expert is not None else _pair_gate(x, gate)
    return dataclasses.replace(x, gate=gate, node=Node("gate", (x.node,)))


def row(eqn, values) -> Lazy:
    """An element-wise operation of lazy values with one layout, and scalars."""
    lazy = [x for x in values if isinstance(x, Lazy)]
    first = lazy[0]
    if any(
        x.labels != first.labels or (x.gate is None) != (first.gate is None) or x.tokens is not first.tokens
        for x in lazy
    ) or any(not isinstance(x, Lazy) and getattr(x, "ndim", 0) for x in values):
        raise DenseFormError(f"`{eqn.primitive.name}` of expert outputs and a value that is not a scalar")
    args = tuple(x.node if isinstance(x, Lazy) else x for x in values)
    node = Node("row", args, params=tuple(sorted(eqn.params.items())), prim=eqn.primitive)
    return first.with_node(node)


def add(a, b, eqn):
    lazy = [x for x in (a, b) if isinstance(x, Lazy)]
    scalars = [x for x in (a, b) if not is_lazy(x) and not getattr(x, "ndim", 0)]
    if lazy and len(lazy) + len(scalars) == 2 and all(x.gate is None for x in lazy):
        return row(eqn, [a, b])
    terms, home = [], []
    for x in (a, b):
        if isinstance(x, LazySum):
            terms += list(x.terms)
            home += [x.home] if x.home is not None else []
        elif isinstance(x, Lazy):
            if x.gate is None or x.expert is None:
                raise DenseFormError("expert outputs added up before the router's weights apply")
            terms.append(x)
        else:
            home.append(x)
    total = home[0] + home[1] if len(home) == 2 else home[0] if home else None
    return LazySum(total, tuple(terms))


def reduce_experts(x: Lazy, axes, ex):
    """`sum over E` of gated expert outputs."""
    if x.gate is None or "E" not in x.labels or tuple(axes) != (x.labels.index("E"),):
        raise DenseFormError("expert outputs summed other than over the experts after the router's weights")
    summed = x.with_node(x.node, tuple(label for label in x.labels if label != "E"))
    return _arranged(materialise(summed, ex), summed, summed.labels)


def plain(x, ex):
    """A lazy value computed (a sum of gated terms), or an error if it cannot be yet."""
    if isinstance(x, LazySum):
        # Terms with one expression run as one exchange; terms of one expert reading different tokens
        # (each its own masked copy, say) go to separate exchanges.
        groups: dict = {}
        for term in x.terms:
            runs = groups.setdefault(term.signature(), [])
            run = next((r for r in runs if all(t.tokens is term.tokens or t.expert != term.expert for t in r)), None)
            if run is None:
                runs.append(run := [])
            run.append(term)
        total = x.home
        for terms in (run for runs in groups.values() for run in runs):
            stacked = _stacked(terms)
            part = _arranged(materialise(stacked, ex), stacked, stacked.labels)
            total = part if total is None else total + part
        return total
    if isinstance(x, Lazy):
        if x.gate is not None and x.expert is not None:
            return plain(LazySum(None, (x,)), ex)
        raise DenseFormError(
            "expert outputs used before the router's weights apply to them and they are summed over the experts"
        )
    if isinstance(x, ExpertSlice):
        raise DenseFormError("an indexed expert weight used other than in a matmul")
    if isinstance(x, Picked):
        raise DenseFormError("gathered expert matrices used other than in a matmul with tokens")
    return x


def _stacked(terms: list[Lazy]) -> Lazy:
    """The terms of a loop over experts as one value over all experts (gates side by side, and the tokens
    too where the experts read different ones)."""
    first = terms[0]
    gate = jnp.zeros((first.tokens.shape[-2], first.experts), first.gate.dtype)
    for term in terms:
        gate = gate.at[:, term.expert].add(term.gate)
    if all(t.tokens is first.tokens for t in terms):
        return dataclasses.replace(first, expert=None, gate=gate)
    return dataclasses.replace(
        first,
        expert=None,
        gate=gate,
        per_expert=True,
        tokens=_tokens_per_expert([(t.expert, t.tokens) for t in terms], first.experts),
    )


def _tokens_per_expert(pairs, experts: int):
    """(E, N, D): expert e's token rows where `pairs` has them, zeros elsewhere (never routed)."""
    rows = pairs[0][1]
    tokens = jnp.zeros((experts, *rows.shape), rows.dtype)
    for e, t in pairs:
        tokens = tokens.at[e].set(t)
    return tokens


def _arranged(out, x: Lazy, labels: tuple):
    """`materialise`'s (token dims..., F) in the dim order `labels` of the block's program."""
    produced = tuple(f"T{k}" for k in range(len(x.token_shape))) + ("F",)
    return jnp.transpose(out, [produced.index(label) for label in labels]) if labels != produced else out


def materialise(x: Lazy, ex):
    """A gated lazy value summed over the experts: each token's routed pairs at their experts' devices,
    the expression there, the results back, summed per token. Returns (token dims..., F)."""
    if not ex.dropless:
        raise DenseFormError(
            "a block that runs every expert on every token takes dispatch: dropless only "
            "(its routing has no fixed number of experts per token to size a capacity from)"
        )
    n, experts = x.tokens.shape[-2], x.experts
    routed = x.gate != 0
    key = jnp.where(routed, jnp.arange(experts), experts).reshape(-1)  # (N * E,), unrouted last
    order = jnp.argsort(key, stable=True)
    sizes = jnp.sum(routed, axis=0).astype(jnp.int32)
    token_of = (order // experts).astype(jnp.int32)
    route = exchange.route(sizes, n * experts, n, ex.axis, ex.size)  # n: each token once per expert
    rows = x.tokens[(order % experts).astype(jnp.int32), token_of] if x.per_expert else x.tokens[token_of]
    held = {
        "tokens": exchange.dispatch(rows, route),
        "gate": exchange.dispatch(x.gate.reshape(-1)[order][:, None], route),
    }
    out = _evaluate(x.node, held, route, {})
    back = exchange.combine(out, route)
    summed = jnp.zeros((n, back.shape[-1]), back.dtype).at[token_of].add(back)
    return summed.reshape(*x.token_shape, back.shape[-1])


def _evaluate(node: Node, held: dict, route, memo: dict):
    if id(node) in memo:
        return memo[id(node)]
    if node.op == "tokens":
        out = held["tokens"]
    elif node.op == "gate":
        value = _evaluate(node.args[0], held, route, memo)
        out = value * held["gate"].astype(value.dtype)
    elif node.op == "matmul":
        params = dict(node.params)
        out = exchange.grouped_matmul(
            _evaluate(node.args[0], held, route, memo),
            node.weight,
            route,
            contracting=node.contract,
            precision=params["precision"],
            preferred_element_type=params["preferred_element_type"],
        )
    else:
        operands = [_evaluate(a, held, route, memo) if isinstance(a, Node) else a for a in node.args]
        out = node.prim.bind(*operands, **dict(node.params))
    memo[id(node)] = out
    return out


def reshaped(eqn, x: Lazy) -> Lazy:
    """A transpose of expert outputs, or a reshape or broadcast that only adds or drops dims of size one
    (`jnp.stack`'s expand_dims, a squeeze): the labels follow, a new dim labelled '1'."""
    name = eqn.primitive.name
    before, after = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if name == "transpose":
        return x.with_node(x.node, tuple(x.labels[d] for d in eqn.params["permutation"]))
    if name == "squeeze":
        dims = set(eqn.params["dimensions"])
        if all(x.labels[d] == "1" for d in dims):
            return x.with_node(x.node, tuple(label for d, label in enumerate(x.labels) if d not in dims))
    elif (
        name == "broadcast_in_dim"
        and before == tuple(after[d] for d in eqn.params["broadcast_dimensions"])
        and all(after[d] == 1 for d in range(len(after)) if d not in eqn.params["broadcast_dimensions"])
    ):
        labels = ["1"] * len(after)
        for k, d in enumerate(eqn.params["broadcast_dimensions"]):
            labels[d] = x.labels[k]
        return x.with_node(x.node, tuple(labels))
    elif (
        name == "reshape"
        and eqn.params.get("dimensions") is None
        and [d for d in before if d != 1] == [d for d in after if d != 1]
    ):
        known = iter(label for label, d in zip(x.labels, before) if d != 1)
        return x.with_node(x.node, tuple(next(known) if d != 1 else "1" for d in after))
    raise DenseFormError(f"expert outputs go into `{name}` other than to add or drop a dim of size one")


def concatenated(eqn, values) -> Lazy:
    """`jnp.stack` of one expression per expert, in expert order, along a new dim (the `stack` primitive, or
    a concatenate of dims of size one): a value over all experts (an 'E' dim), each expert's tokens its
    own where they differ."""
    first = values[0]
    if eqn.primitive.name == "stack":
        dim = eqn.params["axis"]
        labels = first.labels[:dim] + ("E",) + first.labels[dim:]
    else:
        dim = eqn.params["dimension"]
        labels = first.labels[:dim] + ("E",) + first.labels[dim + 1 :] if first.labels[dim] == "1" else None
    if (
        labels is None
        or len(values) != first.experts
        or not all(
            isinstance(v, Lazy)
            and v.gate is None
            and v.expert == k
            and v.labels == first.labels
            and v.signature() == first.signature()
            for k, v in enumerate(values)
        )
    ):
        raise DenseFormError("expert outputs stacked other than one per expert, in expert order, along a new dim")
    if all(v.tokens is first.tokens for v in values):
        return dataclasses.replace(first, labels=labels, expert=None)
    return dataclasses.replace(
        first,
        labels=labels,
        expert=None,
        per_expert=True,
        tokens=_tokens_per_expert([(v.expert, v.tokens) for v in values], first.experts),
    )
