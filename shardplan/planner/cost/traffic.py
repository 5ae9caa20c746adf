"""The collectives a step runs under a plan, as XLA's SPMD partitioner emits them for each layout
(measured on the compiled HLO, `benchmarks/cost_model.py`), and the seconds each takes on a profile's
links. Pure.
"""

from __future__ import annotations

import dataclasses
import math

from shardplan.core.layout import ParamLayout
from shardplan.core.roles import COLUMN, EMBEDDING, MATMUL, ROW, ModelRoles, Role
from shardplan.core.transfers import Transfer
from shardplan.pipeline.cost import stage_transfers
from shardplan.plan.schema import spec_axes
from shardplan.planner.cost.step import TOKEN_BYTES, Step, before_layers_in_loop, head_ways, split_axes, tensor_ways
from shardplan.planner.profiles import Profile

GRADIENT_REDUCTION = "gradients, data parallel"


def collectives_of(held: list[ParamLayout], roles: ModelRoles, step: Step) -> list[Transfer]:
    transfers: list[Transfer] = []
    reductions: dict[tuple[str, ...], int] = {}
    after = roles.after_layers
    for p in held:
        role = roles.roles.get(p.path)
        if role is None:
            continue
        mine, count = [], step.count(p.path)
        in_layer = roles.layer_of(p.path) is not None
        staged = p.stage is not None
        moved_activations = False
        head = step.tabled and (p.path in after or p.path in roles.tied)  # a tied embedding is a head too
        gathered = p.bytes_per_device * (head_ways(p, roles, step) - 1) if head else 0
        if gathered:
            # 1F1B runs such a head inside the pipeline whole: its split weight is gathered once per step
            mine.append(
                Transfer(
                    "all-gather",
                    tuple(spec_axes(p.spec)),
                    p.bytes_per_device + gathered,
                    1,
                    f"{p.path}: 1F1B head gathered for the step",
                )
            )
        elif role.kind in (EMBEDDING, COLUMN, ROW, MATMUL):
            found, moved_activations = matrix_transfers(p, role, step, staged, in_layer)
            mine += found
            if p.path in roles.tied and any(a in step.batch_axes for a in spec_axes(p.spec)):
                # its second use, the logits, is a head whose vocabulary the batch axes split: XLA moves
                # that head's activations as for any FSDP-split head
                mine += matrix_transfers(p, Role(p.path, COLUMN, (1,), (0,)), step, staged, in_layer)[0]
        axes = spec_axes(p.spec)
        fsdp = [a for a in axes if a in step.batch_axes]
        # (a layer weight FSDP-split inside a pipeline is whole in the loop: so is its gradient)
        whole_in_loop = staged and bool(fsdp)
        reduce_over = tuple(a for a in step.batch_axes if a not in axes or whole_in_loop)
        if fsdp and not moved_activations and not whole_in_loop:
            transfers += repeated(mine, count)
            continue  # its whole gradient was all-reduced with the gather
        if p.opt_spec != p.spec:  # ZeRO-1 updates a shard, then gathers the parameter
            extra = tuple(a for a in spec_axes(p.opt_spec) if a not in axes)
            mine.append(
                Transfer(
                    "all-gather",
                    extra,
                    int(p.bytes_per_device * step.widening(p)),
                    1,
                    f"{p.path}: ZeRO-1 update gathered",
                )
            )
            in_loop = step.tabled and p.path in after
            passes, tokens = step.passes(staged)
            n_in = math.prod(p.shape[d] for d in role.in_dims)
            inputs_gathered = int(tokens * step.ways(extra) * n_in * step.itemsize)
            if (
                role.kind == COLUMN
                and not role.closes
                and extra
                and not in_loop
                and inputs_gathered < p.bytes_per_device * step.widening(p)
            ):
                # XLA gathers the head's input activations and computes each shard's gradient whole, where
                # they are smaller than the gradient it would reduce (compiled MiniGPT steps under zero1:
                # at data 2 it gathers 32 KiB of inputs for a 128 KiB head; at data 8, 128 KiB of inputs,
                # it reduces the gradient): the gather never outgrows the head
                mine.append(
                    Transfer(
                        "all-gather", extra, inputs_gathered, passes, f"{p.path}: ZeRO-1 head activations gathered"
                    )
                )
                reduce_over = tuple(a for a in reduce_over if a not in extra)
        # a gathered head's gradient is computed, reduced and moved whole inside the pipeline
        size = p.bytes_per_device * (step.ways(fsdp) if whole_in_loop else 1) + gathered
        if reduce_over:
            group = reduce_over + ((step.stage_axis,) if step.stage_axis and not staged and not step.tabled else ())
            key = (group, step.reductions_per_step())
            # a tied embedding's two uses (lookup, logits) are reduced separately
            reductions[key] = reductions.get(key, 0) + int(size * step.widening(p)) * count * (
                2 if p.path in roles.tied else 1
            )
        if p.path in step.on_stages:
            # gathered over the stages for the step; its gradient, reduced as if whole, is returned to
            # the stages' split by an all-to-all (XLA's reshard; measured), in place of the moves below
            mine += [
                Transfer(
                    "all-gather",
                    (step.stage_axis,),
                    p.bytes_per_device,
                    1,
                    f"{p.path}: gathered over the stages for the step",
                ),
                Transfer(
                    "all-to-all",
                    (step.stage_axis,),
                    p.bytes_per_device,
                    1,
                    f"{p.path}: gradient returned to its split over the stages",
                ),
            ]
        elif before_layers_in_loop(p, roles, step):
            # the first stage computes its gradient in the loop; the other stages take it from there
            mine.append(
                Transfer("all-reduce", (step.stage_axis,), size, 1, f"{p.path}: 1F1B gradient from the first stage")
            )
        if head and p.path not in step.on_stages:
            mine.append(Transfer("all-reduce", (step.stage_axis,), size, 1, f"{p.path}: 1F1B head reduced over stages"))
            mine.append(
                Transfer(
                    "collective-permute", (step.stage_axis,), size, 1, f"{p.path}: 1F1B head moved to the first stage"
                )
            )
        transfers += repeated(mine, count)
    for (axes, ops), nbytes in reductions.items():
        what = GRADIENT_REDUCTION + ("" if ops == 1 else ", per microbatch")
        transfers.append(Transfer("all-reduce", axes, nbytes, ops, what, "backward"))
    if step.stage_axis is not None:
        transfers += stage_transfers(
            step.stage_axis,
            step.schedule,
            tabled=step.tabled,
            stages=step.stages,
            microbatches=step.microbatches,
            virtual=step.virtual,
            microbatch_bytes=int(step.tokens / step.microbatches * step.width * step.itemsize),
            whole_bytes=int(step.tokens * step.width * step.itemsize),
            tensor_axes=step.send_axes(),
            tensor_ways=math.prod(step.sizes[a] for a in step.send_axes()),
        )
    return merge_transfers(transfers)


def repeated(transfers: list[Transfer], n: int) -> list[Transfer]:
    return transfers if n == 1 else [dataclasses.replace(t, count=t.count * n) for t in transfers]


def matrix_transfers(
    p: ParamLayout, role: Role, step: Step, staged: bool, in_layer: bool = False
) -> tuple[list[Transfer], bool]:
    """Transfers a matrix causes; True when XLA moves activations rather than the FSDP-split weight."""
    passes, tokens = step.runs(staged)
    b = step.itemsize
    shape = p.shape
    tensor_in = split_axes(p, role.in_dims, step.batch_axes)
    tensor_out = split_axes(p, role.out_dims, step.batch_axes)
    fsdp = tuple(a for a in spec_axes(p.spec) if a in step.batch_axes)
    n_in = math.prod(shape[d] for d in role.in_dims)
    n_out = math.prod(shape[d] for d in role.out_dims)
    forward = 2 if step.recomputes(staged, in_layer) else 1  # the forward runs again in the backward
    # under sequence parallelism a layer matrix's tensor collectives are an all-gather before it or a
    # reduce-scatter after it, which collective matmul runs beside the matmul's pieces
    lane = "tensor" if step.tensor_overlap and step.sequence_ways > 1 and in_layer else "critical"
    found: list[Transfer] = []
    if role.kind == EMBEDDING:
        if tensor_in:
            found.append(
                Transfer(
                    "all-reduce",
                    tensor_in,
                    int(tokens * n_out * b / step.ways(tensor_out)),
                    passes,
                    f"{p.path}: split-vocabulary lookup",
                )
            )
        if tensor_out:
            found.append(
                Transfer("all-gather", tensor_out, int(tokens * n_out * b), passes, f"{p.path}: lookup gathered")
            )
    else:
        if tensor_out:
            found.append(
                Transfer(
                    "all-reduce",
                    tensor_out,
                    int(tokens * n_in * b / step.ways(tensor_in)),
                    passes,
                    f"{p.path}: input gradient (outputs split)",
                    lane,
                )
            )
            if role.kind == COLUMN and not role.closes:
                found.append(
                    Transfer(
                        "all-reduce",
                        tensor_out,
                        int(tokens * TOKEN_BYTES),
                        3 * passes,
                        f"{p.path}: loss over split outputs",
                    )
                )
            elif role.kind != COLUMN:
                found.append(
                    Transfer(
                        "all-gather", tensor_out, int(tokens * n_out * b), passes, f"{p.path}: split outputs gathered"
                    )
                )
        if tensor_in:
            found.append(
                Transfer(
                    "all-reduce",
                    tensor_in,
                    int(tokens * n_out * b / step.ways(tensor_out)),
                    forward * passes,
                    f"{p.path}: partial outputs summed",
                    lane,
                )
            )
    if staged:
        found = [dataclasses.replace(t, looped=True) for t in found]
    if not fsdp:
        return found, False
    ways = step.ways(fsdp)
    # the weight is cast to the compute dtype before XLA gathers it; its gradient comes back so
    whole = math.prod(p.shard_shape) * min(p.itemsize, step.itemsize) * ways
    if staged:
        # the pipeline's loop runs the batch axes manually: the weight enters it gathered over them, once
        # a step, and its whole gradient is reduced after the loop with the others (`collectives_of`)
        return found + [
            Transfer("all-gather", fsdp, whole, 1, f"{p.path}: FSDP weight gathered as the loop starts")
        ], False
    # Inside a pipeline loop the weight is gathered again for the backward (1F1B: also for the
    # recomputed forward) and its gradient reduced per microbatch; gradient accumulation gathers
    # and reduces once per microbatch. A rematerialised layer gathers again as its forward reruns
    # (the gathered weight is neither kept nor a saved matmul output), and so does one that is not
    # where the device keeps the remat's barriers (`step.regathers`).
    gathers = (3 if step.tabled else 2) if staged else 1 + (in_layer and (step.remat != "none" or step.regathers))
    gather_weight = [
        Transfer("all-gather", fsdp, whole, gathers * passes, f"{p.path}: FSDP weight gathered", "prefetch"),
        Transfer("all-reduce", fsdp, whole, passes, f"{p.path}: FSDP gradient", "backward"),
    ]
    split_rows = role.kind == EMBEDDING and set(fsdp) <= set(split_axes(p, role.in_dims))
    split_outputs = role.kind in (COLUMN, MATMUL) and set(fsdp) <= set(split_axes(p, role.out_dims))
    if split_rows:
        gathered = int(tokens * ways * n_out * b)
        moved = [
            Transfer("all-reduce", fsdp, gathered, passes, f"{p.path}: lookup over the whole batch"),
            Transfer("all-gather", fsdp, gathered, passes, f"{p.path}: lookup gradient gathered"),
        ]
    elif split_outputs:
        gathered = int(tokens * ways * n_in * b)
        moved = [
            Transfer("all-gather", fsdp, gathered, passes, f"{p.path}: activations gathered"),
            Transfer("all-reduce", fsdp, gathered, passes, f"{p.path}: input gradient"),
            Transfer(
                "all-to-all",
                fsdp,
                int(tokens * n_out * b / step.ways(tensor_out)),
                passes,
                f"{p.path}: output gradient relaid out",
            ),
        ]
    else:
        return found + gather_weight, False
    if sum(t.total for t in moved) < sum(t.total for t in gather_weight):
        return found + moved, True
    return found + gather_weight, False


def merge_transfers(transfers: list[Transfer]) -> list[Transfer]:
    """One entry per (kind, axes, bytes, what) with the counts added."""
    merged: dict[tuple, Transfer] = {}
    for t in transfers:
        key = (t.kind, t.axes, t.bytes, t.what)
        merged[key] = dataclasses.replace(t, count=merged[key].count + t.count) if key in merged else t
    return [t for t in merged.values() if t.count and t.bytes]


def gathered_outside_layers(p: ParamLayout, roles: ModelRoles, step: Step) -> bool:
    """Whether XLA gathers this FSDP-split matrix outside the layers whole (a 1F1B head: counted as
    one, whole; otherwise when moving activations would cost more, see `matrix_transfers`)."""
    role = roles.roles.get(p.path)
    if role is None or role.kind not in (EMBEDDING, COLUMN, ROW, MATMUL):
        return False
    if step.tabled and (p.path in roles.after_layers or p.path in roles.tied):
        return False
    return not moves_activations(p, role, step)


def moves_activations(p: ParamLayout, role: Role, step: Step) -> bool:
    """Whether XLA runs this FSDP-split matrix by moving activations rather than gathering it."""
    return (
        any(a in step.batch_axes for a in spec_axes(p.spec)) and matrix_transfers(p, role, step, p.stage is not None)[1]
    )


def kv_widths(held: list[ParamLayout], roles: ModelRoles, step: Step) -> dict:
    """Attention layer -> its key (= value) width per device, for the layers held, under a context axis."""
    if step.context is None:
        return {}
    layouts = {p.path: p for p in held}
    found = {}
    for attention in roles.attention:
        keys = [layouts[m] for m in attention.members[1:] if m in layouts]
        if not keys:
            continue
        widths = [
            math.prod(p.shape[d] for d in roles.roles[p.path].out_dims)
            / tensor_ways(p, roles.roles[p.path].out_dims, step)
            for p in keys
        ]
        found[attention.layer] = sum(widths) / 2  # keys and values: two matrices, or one fused
    return found


def context_terms(held: list[ParamLayout], roles: ModelRoles, step: Step):
    """The plan's context parallelism, costed by `shardplan.context.cost`."""
    from shardplan.context.cost import context_cost

    widths = kv_widths(held, roles, step)
    stands_for = {roles.layer_of(p.path): step.count(p.path) for p in held}
    staged = step.stage_axis is not None
    passes, tokens = step.runs(staged)
    ways = step.ways((step.context,)) if step.context else 1
    gradients = sum(
        int(p.bytes_per_device * step.count(p.path) * step.widening(p))
        for p in held
        if step.context not in spec_axes(p.spec)
    )
    return context_cost(
        [w for layer, w in widths.items() for _ in range(stands_for.get(layer, 1))],
        strategy="ring" if step.ring else "all_gather",
        axis=step.context or "",
        ways=ways,
        rows=tokens * ways / step.seq,
        seq=step.seq,
        itemsize=step.itemsize,
        passes=passes,
        gradient_bytes=gradients,
        reductions=step.reductions_per_step(),
        looped=staged,
    )


def transfer_seconds(t: Transfer, step: Step, profile: Profile, hosts: dict[str, int]) -> float:
    """Ring algorithms: an all-reduce sends 2(n-1)/n of its bytes, a gather or all-to-all (n-1)/n."""
    n = step.ways(t.axes)
    factor = {
        "all-reduce": 2 * (n - 1) / n,
        "all-gather": (n - 1) / n,
        "all-to-all": (n - 1) / n,
        "reduce-scatter": float(n - 1),
        "collective-permute": 1.0,
    }[t.kind]
    bandwidth = link_bandwidth(t.axes, n, profile, hosts) * profile.collective_shares.get(t.kind, 1.0)
    return t.count * (profile.collective_latency + factor * t.bytes / bandwidth)


def link_bandwidth(axes: tuple[str, ...], n: int, profile: Profile, hosts: dict[str, int]) -> float:
    """Bytes/s one device moves in a collective over `axes`. Inside a host: its links. Across hosts,
    NCCL-style rings cross between hosts once per ring and run one ring per device of the group
    inside a host, each over that device's own link: k devices per host move k links' worth, up to
    the links inside the host."""
    spanned = math.prod(hosts.get(a, 1) for a in axes)
    if spanned <= 1:
        return profile.intra_host_bandwidth * profile.link_efficiency
    local = max(1, n // spanned)
    return min(profile.intra_host_bandwidth, local * profile.inter_host_bandwidth) * profile.link_efficiency
