"""`shardplan auto` at the edges: build the model abstractly, search with progress, print, measure, write."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardplan.core.layout import human_bytes
from shardplan.plan.inert import inert
from shardplan.planner import auto as planner
from shardplan.planner.cost import Workload
from shardplan.planner.evidence import best_published, beyond_evidence
from shardplan.cli.terminal import consoles, print_wrapped

EXIT_OK, EXIT_NOTHING_FITS = 0, 1


@dataclasses.dataclass(frozen=True)
class AutoRequest:
    """What `shardplan auto` was asked (its command line, parsed)."""

    factory: str
    config: dict
    devices: int
    hosts: int
    memory: int | None  # bytes per device; None: the profile's
    batch: int
    seq: int
    profile: Any
    input_name: str
    output: str
    top: int  # rows of the table
    measure: int  # candidates to time (0: none)
    as_json: bool
    command: str  # as typed, for the written plan's header
    paths: tuple[str, ...] = ()  # extra import paths for the model
    compute: str | None = None
    margin: float | None = None
    capacity: float | None = None
    refit_to: str | None = None  # --calibrate: the profile to write
    measure_timeout: float = 300.0  # seconds one candidate may take to build, trace and compile


def run_auto(console: Console, request: AutoRequest, usage_error) -> int:
    if request.as_json:  # stdout carries the JSON document alone: every line said beside it goes to stderr
        console = consoles()[1]
    capacity = request.capacity  # (dropped below when the model has no MoE blocks)
    from shardplan.model.factory import ModelLoadError, build_model
    from shardplan.core.paths import param_infos
    from shardplan.experts.roles import find_blocks
    from shardplan.planner.kept import with_code
    from shardplan.core.roles import definition_order, recognise

    order: list[str] = []
    with console.status("building the model abstractly (nothing is allocated)"):
        try:
            model = build_model(
                request.factory,
                request.config,
                paths=request.paths,
                on_built=lambda m: order.extend(definition_order(m)),
            )
        except ModelLoadError as exc:
            raise usage_error(str(exc)) from None
    params = param_infos(model)
    workload = Workload(request.batch, request.seq)
    with console.status("reading what the model's code keeps for the backward (one traced forward)"):
        roles = with_code(recognise(params, order), model, request.seq, input_name=request.input_name, params=params)
    if not roles.code.traced:
        console.print(
            Text.assemble(
                ("activations counted as a plain transformer's: ", "bold"),
                f"the forward could not be traced with `{request.input_name}` alone",
            )
        )
    if capacity is not None:
        if not find_blocks(params):  # (found once: the search asks again with the same list)
            console.print(
                Text.assemble(
                    ("--capacity-factor changes nothing: ", "bold"),
                    "the model has no MoE blocks (a router whose experts are stacked weights) to make expert-parallel",
                )
            )
            capacity = None
    refusal = _pipeline_refusal(model, roles.layers, request.input_name, workload)
    if refusal:
        console.print(Text.assemble(("no pipeline candidates: ", "bold"), refusal))
    elif roles.layers is None and (stacks := _stacked_layers(model)):
        path, depth = stacks[0]
        print_wrapped(
            console,
            f"no pipeline candidates: the layers at `{path}` are one module stacked by nnx.vmap ({depth} layers), "
            f"and auto proposes pipelines over a list of layers only; a plan of your own with `pipeline: "
            f"{{layers: {path}, ...}}` runs them (`shardplan validate` checks it)",
        )
    with console.status(f"costing candidate plans for {request.devices} devices") as status:

        def progress(done: int, total: int) -> None:
            status.update(
                f"costing candidate plans for {request.devices} devices: {done:,} of {total:,} (bounded: the "
                "rest may not need costing)"
            )

        found = planner.search(
            params,
            roles,
            planner.SearchRequest(
                devices=request.devices,
                workload=workload,
                profile=request.profile,
                memory=request.memory,
                hosts=request.hosts,
                input_name=request.input_name,
                model={"factory": request.factory, "config": request.config},
                pipelines=refusal is None,
                compute=request.compute,
                margin=planner.MEMORY_MARGIN if request.margin is None else request.margin,
                capacity=capacity,
            ),
            progress=progress,
            keep=max(planner.KEEP, request.top, request.measure),
            check=max(planner.KEEP, request.measure),
        )
    measured = {}
    if request.measure and found.ranked:
        measured = _measure(
            console,
            found,
            request.factory,
            request.config,
            request.measure,
            request.paths,
            request.input_name,
            timeout=request.measure_timeout,
        )
        modelled_order = list(found.ranked)
        found = _rerank(found, measured)
    if request.as_json:
        print(json.dumps(_json(found, measured, request.top), indent=2))
    else:
        _print_table(console, found, measured, request.top)
        if measured:
            _print_agreement(console, modelled_order, measured)
    refit_failed = None
    if request.refit_to and measured:
        refit_failed = _write_refit(console, found, modelled_order, measured, request.refit_to)
    elif request.refit_to:
        print_wrapped(consoles()[1], f"--calibrate: no candidate was timed, so {request.refit_to} was not written")
    if not found.ranked:
        console.print(
            Text.assemble(
                (f"no candidate fits {human_bytes(found.usable)} per device", "bold red"),
                f" (the budget {human_bytes(found.memory)} less the safety margin; "
                f"{len(found.rejected)} tried); raise --memory-per-device, add devices, "
                "lower --batch/--seq" + ("" if request.compute == "bfloat16" else " or try --compute-dtype bfloat16"),
            )
        )
        nearest = planner.smallest_peak(found)
        if nearest:
            print_wrapped(console, nearest)
        return EXIT_NOTHING_FITS
    claim = beyond_evidence(model_flops_utilisation(found, found.best), found.profile)
    note = " ".join(filter(None, [_measured_line(found, measured), claim and f"Note: {claim}."]))
    text = planner.plan_text(found.best, found, command=request.command, measured=note)
    _check_written(text, found)
    try:
        _write_atomically(Path(request.output), text)
    except OSError as exc:
        raise usage_error(f"cannot write {request.output}: {exc.strerror or exc}") from None
    if not request.as_json:
        import shlex

        check = " ".join(
            [
                "shardplan validate",
                shlex.quote(str(request.output)),
                "--model",
                shlex.quote(request.factory),
                "--devices",
                str(request.devices),
                *(f"--path {shlex.quote(p)}" for p in request.paths),
            ]
        )
        print_wrapped(
            console,
            Text.assemble(
                "wrote ",
                (request.output, "bold"),
                f": {found.best.candidate.label()}, {found.best.candidate.rules_label()}; check it with `{check}`",
            ),
        )
    if refit_failed:  # (the plan is written; the refitted profile is not, and the exit status says so)
        raise usage_error(refit_failed)
    return EXIT_OK


def _check_written(text: str, found: planner.Search) -> None:
    """The written text must load back to the plan the search checked in full (`Search.ranked`); a
    difference is a bug of ours. (Loading is cheap; checking the whole model again is not.)"""
    from shardplan.plan.loader import parse_plan

    written = parse_plan(text, file="auto").model_dump(exclude={"name"})
    chosen = found.best.plan.model_dump(exclude={"name"})
    if written != chosen:
        differ = sorted(k for k in chosen if written.get(k) != chosen[k])
        raise AssertionError(f"auto wrote a plan that differs from the one it checked in its {', '.join(differ)}")


def _pipeline_refusal(model, layers: str | None, input_name: str, workload: Workload) -> str | None:
    """Why the model cannot run its repeated layers as a pipeline (found by tracing one call on a
    batch of token ids abstractly, as `check` does); None if it can or has no such layers."""
    if layers is None:
        return None
    import jax.numpy as jnp

    from shardplan.core.calls import call_with, check_layer_calls
    from shardplan.plan.schema import Plan

    plan = Plan.model_validate(
        {
            "version": 1,
            "mesh": {"axes": {"stage": 2}},
            "params": [{"match": ".*", "spec": []}],
            "pipeline": {"axis": "stage", "layers": layers},
        }
    )
    tokens = jnp.zeros((workload.batch, workload.seq), jnp.int32)
    found = check_layer_calls(plan, model, call_with(model, {input_name: tokens}))
    return found[0].message if found else None


def _stacked_layers(model) -> list[tuple[str, int]]:
    """(path, layer count) of each outermost module stacked by `nnx.vmap` / `nnx.scan` in `model`."""
    import jax
    from flax import nnx

    from shardplan.pipeline.stacked import stacked_depth

    stacks = []
    for keys, node in nnx.iter_graph(model):
        depth = stacked_depth(node) if keys else None
        ranks = {len(getattr(a, "shape", ())) for a in jax.tree.leaves(nnx.state(node))} if depth else set()
        # (stacked vectors stay matrices, and some matrix becomes rank 3: not an embedding or a Linear)
        if depth is not None and depth > 1 and min(ranks) >= 2 and max(ranks) >= 3:
            stacks.append(("/".join(str(k) for k in keys), depth))
    stacks.sort(key=lambda found: found[0].count("/"))  # (the graph is walked children first)
    outermost: list[tuple[str, int]] = []
    for path, depth in stacks:
        if not any(path.startswith(kept + "/") for kept, _ in outermost):
            outermost.append((path, depth))
    return outermost


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file beside it, renamed; removed on failure),
    with the mode of the file it replaces, or else the one the user's umask gives a new file (a private
    temporary file's 0600 would otherwise lock others out of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "w") as handle:
            handle.write(inert(text))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(path: Path) -> int:
    """The permission bits a file written at `path` should have: the replaced file's, else 0666 less the umask."""
    import stat

    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _key(item: planner.Ranked) -> tuple[str, str]:
    return item.candidate.label(), item.candidate.rules_label()


MEASURED_ROUNDS = 7  # rounds of one timed step per candidate, after one round to warm up


def _measure(
    console: Console,
    found: planner.Search,
    factory: str,
    config: dict,
    k: int,
    paths: tuple[str, ...] = (),
    input_name: str = "tokens",
    *,
    timeout: float = 300.0,
) -> dict:
    """Compile the top k candidates, then time them in `MEASURED_ROUNDS` interleaved rounds (the fastest);
    {candidate key: Measured}. A candidate whose step cannot be built or run (the model's forward needs
    more than token ids, the compiler fails, memory runs out) or takes more than `timeout` seconds to
    build and compile is reported and skipped: the search goes on."""
    import jax
    from shardplan.compose.measure import compile_step, time_interleaved
    from shardplan.model.factory import build_model

    ready = {}
    for index, ranked in enumerate(found.ranked[:k]):
        needed = planner.total_devices(ranked.candidate.axes)
        if needed > jax.device_count():
            console.print(
                f"skipping measurement of {ranked.candidate.label()}: needs {needed} devices, "
                f"{jax.device_count()} present"
            )
            continue
        with console.status(
            f"compiling candidate {index + 1}/{min(k, len(found.ranked))}: "
            f"{ranked.candidate.label()}, {ranked.candidate.rules_label()}"
        ):
            try:
                with time_limit(timeout, f"took more than {timeout:g} s to build and compile (--measure-timeout)"):
                    model = build_model(factory, config, abstract=False, paths=paths)
                    ready[_key(ranked)] = compile_step(
                        ranked.plan, model, found.workload.batch, found.workload.seq, input_name=input_name
                    )
            except Exception as error:  # the model's own code on token ids, the compiler, memory, the time limit
                _skipped(console, ranked, error)
    keys = list(ready)
    with console.status("timing") as status:
        seconds = time_interleaved(
            [ready[key] for key in keys],
            MEASURED_ROUNDS,
            progress=lambda r: status.update(
                f"timing {len(keys)} candidates, one step each in turn: round {r} of {MEASURED_ROUNDS}"
                + (" (warm-up)" if r == 0 else "")
            ),
        )
    results = {}
    for key, got in zip(keys, seconds):
        if isinstance(got, Exception):
            _skipped(console, next(r for r in found.ranked if _key(r) == key), got)
        else:
            results[key] = dataclasses.replace(ready[key].figures, step_s=got)
    return results


class TimeLimit(Exception):
    """A candidate's work ran past `--measure-timeout`."""


@contextlib.contextmanager
def time_limit(seconds: float, message: str):
    """Raise `TimeLimit(message)` in the main thread once `seconds` of wall time pass inside the block (a
    trace that loops in Python is stopped there; a call inside the compiler when it returns). Elsewhere
    than the main thread of a POSIX process, no limit."""
    import signal
    import threading

    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeLimit(message)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _skipped(console: Console, ranked: planner.Ranked, error: Exception) -> None:
    console.print(
        f"could not measure {ranked.candidate.label()}, {ranked.candidate.rules_label()} (skipped): "
        f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    )


def _measured_line(found: planner.Search, measured: dict) -> str:
    got = measured.get(_key(found.best)) if found.best is not None else None
    if got is None or got.step_s is None:
        return ""
    return (
        f"Chosen by measurement: the fastest of the {len(measured)} best candidates compiled and timed on "
        f"the devices at hand, {planner.seconds(got.step_s)} a step (modelled "
        f"{planner.seconds(found.best.estimate.step_s)}), compiled peak {human_bytes(got.peak_bytes)}."
    )


def _rerank(found: planner.Search, measured: dict) -> planner.Search:
    """The timed candidates first, fastest measured step first (a compiled peak over the budget
    rejects); the others after them in the model's order."""
    timed, rest, rejected = [], [], list(found.rejected)
    for item in found.ranked:
        got = measured.get(_key(item))
        if got is None or got.step_s is None:
            rest.append(item)
        elif got.peak_bytes > found.memory:
            rejected.append(dataclasses.replace(item, rejected="compiled memory over the budget"))
        else:
            timed.append((got.step_s, item))
    ranked = [item for _, item in sorted(timed, key=lambda pair: pair[0])] + rest
    return dataclasses.replace(found, ranked=ranked, rejected=rejected)


def agreement(ranked: list[planner.Ranked], measured: dict) -> tuple[list[tuple], float | None]:
    """[(candidate, modelled s, measured s)] of the timed candidates in the model's order, and Kendall's
    tau between the two orders (None under two)."""
    from shardplan.planner.agreement import kendall_tau

    rows = [
        (item, item.estimate.step_s, measured[_key(item)].step_s)
        for item in ranked
        if _key(item) in measured and measured[_key(item)].step_s is not None
    ]
    tau = kendall_tau([r[1] for r in rows], [r[2] for r in rows]) if len(rows) >= 2 else None
    return rows, tau


def _print_agreement(console: Console, modelled_order: list[planner.Ranked], measured: dict) -> None:
    rows, tau = agreement(modelled_order, measured)
    if not rows:
        return
    ratios = sorted(abs(model / seen - 1) for _, model, seen in rows)
    within = sum(r <= 0.2 for r in ratios)
    print_wrapped(
        console,
        f"measured {len(rows)} candidates (the fastest of {MEASURED_ROUNDS} interleaved steps): modelled / "
        f"measured step {', '.join(f'{m / s:.2f}' for _, m, s in rows)} (in the model's order); "
        f"{within} of {len(rows)} within 20%; the model's ranking against the measured one: "
        f"Kendall tau {'-' if tau is None else f'{tau:.2f}'}; the written plan is the measured "
        "fastest within the budget",
    )


def _write_refit(
    console: Console, found: planner.Search, modelled_order: list[planner.Ranked], measured: dict, path: str
) -> str | None:
    """`--calibrate FILE`: the profile's rates refitted to the timed steps, written to FILE; why it could
    not be written, or None."""
    from shardplan.planner.agreement import refit
    from shardplan.planner.profiles import profile_file_text

    rows, _ = agreement(modelled_order, measured)
    points = [
        # (the contention is a share of the hidden collectives' time: it scales with the links)
        (
            item.estimate.compute_s + item.estimate.update_s,
            item.estimate.exposed_communication_s + item.estimate.contention_s,
            seen,
        )
        for item, _, seen in rows
    ]
    if not points:
        return None
    fitted = refit(found.profile, points)
    lines = [
        f"{found.profile.name} ({found.profile.source}) refitted by `shardplan auto --measure --calibrate` to "
        f"{len(points)} timed steps (batch {found.workload.batch} x {found.workload.seq}): "
        + "; ".join(fitted.moved()),
        f"median |modelled / measured - 1| on those steps: {fitted.error_before:.0%} before, "
        f"{fitted.error_after:.0%} after (the same steps: check it on another workload)",
    ]
    try:
        _write_atomically(Path(path), profile_file_text(fitted.profile, lines))
    except OSError as exc:
        return f"cannot write the refitted profile {path}: {exc.strerror or exc}"
    print_wrapped(
        console,
        f"wrote {path}: " + "; ".join(fitted.moved()) + f" (median error on the timed steps "
        f"{fitted.error_before:.0%} -> {fitted.error_after:.0%})",
    )
    return None


def model_flops_utilisation(found: planner.Search, item: planner.Ranked) -> float:
    """The candidate's modelled MFU: the model's matmul FLOPs (nothing recomputed) per modelled step, over
    its devices' dense bf16 peak."""
    from shardplan.planner.cost import model_flops

    flops = sum(model_flops(found.params, found.roles, found.workload, capacity=item.candidate.capacity or 1.0))
    peak = found.profile.peak_flops_by_dtype.get("bfloat16", found.profile.peak_flops)
    return flops / item.estimate.step_s / planner.total_devices(item.candidate.axes) / peak


def _print_table(console: Console, found: planner.Search, measured: dict, top: int) -> None:
    from shardplan.cli.terminal import print_table

    title = (
        f"best {len(found.ranked)} of {found.fitting} plans that fit {human_bytes(found.usable)} per device "
        f"(budget less the safety margin; {found.profile.name}, batch {found.workload.batch} x "
        f"{found.workload.seq})"
    )
    if found.profile.defaults_line():
        print_wrapped(console, Text(found.profile.defaults_line(), style="yellow"))
    columns = ["#", "mesh", "rules", "bytes/device", "communication", "step (modelled)", "MFU"]
    columns += ["measured step", "compiled: moved / peak"] if measured else []
    columns += ["why it lost"]
    best = found.best
    rows, claims = [], None

    def _gap(item: planner.Ranked, winner: planner.Ranked) -> float | None:
        mine, theirs = measured.get(_key(item)), measured.get(_key(winner)) if winner else None
        if mine is None or theirs is None or mine.step_s is None or theirs.step_s is None:
            return None
        return mine.step_s - theirs.step_s

    for rank, item in enumerate(found.ranked[:top], 1):
        cost = item.estimate
        mfu = model_flops_utilisation(found, item)
        claim = beyond_evidence(mfu, found.profile)
        claims = claims or claim
        row = [
            str(rank),
            item.candidate.label(),
            item.candidate.rules_label(),
            human_bytes(cost.peak_bytes),
            f"{human_bytes(cost.collective_bytes)} / {cost.collective_count} ops",
            planner.seconds(cost.step_s),
            f"{mfu:.0%}" + (" (!)" if claim else ""),
        ]
        if measured:
            got = measured.get(_key(item))
            row.append(planner.seconds(got.step_s) if got and got.step_s is not None else "-")
            row.append(f"{human_bytes(got.collectives.total_bytes)} / {human_bytes(got.peak_bytes)}" if got else "-")
        rows.append(row + ["chosen" if item is best else planner.why_lost(item, best, measured_gap=_gap(item, best))])
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    if sum(widths) + 3 * len(columns) + 1 <= console.width:
        print_wrapped(console, Text(title, style="bold"))
        table = Table()
        for column in columns:
            table.add_column(column, justify="right" if column in ("#", "bytes/device", "communication") else "left")
        for row in rows:
            table.add_row(*row)
        print_table(console, table)
    else:  # too wide for the console: each candidate as its cells, named, wrapped
        print_wrapped(console, Text(title, style="bold"))
        for row in rows:
            print_wrapped(console, Text.assemble((f"{row[0]}. {row[1]}, {row[2]}", "bold"), f": {row[-1]}"), indent=4)
            print_wrapped(console, "    " + "; ".join(f"{c} {v}" for c, v in zip(columns[3:-1], row[3:-1])), indent=6)
    if claims:
        record = best_published(found.profile)
        print_wrapped(
            console,
            Text.assemble(
                ("(!) ", "bold yellow"),
                f"MFU above the best published run on "
                f"{record.hardware} ({record.mfu:.0%}: {record.source}): a claim "
                "without evidence; measure before trusting it (--measure, or `shardplan "
                "calibrate` for a profile)",
            ),
        )
    reasons: dict[str, int] = {}
    for item in found.rejected:  # "accumulation not needed: fits with 2" and "...: fits with none" are one reason
        why = item.rejected.split(":")[0]
        reasons[why] = reasons.get(why, 0) + 1
    if reasons:
        print_wrapped(console, "not shown: " + ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())))
    unchecked = sum(1 for item in found.ranked[:top] if item.plan is None)
    if unchecked:
        print_wrapped(
            console,
            f"the last {unchecked} shown were costed on one layer standing for all (the same "
            "modelled figures) and not checked in full; write one out with its options to check it",
        )
    if found.pruned:
        print_wrapped(
            console,
            f"{found.pruned} candidates were not costed: a lower bound on their step time exceeds the shown plans'",
        )
    if best is not None:
        for caveat in best.estimate.caveats:
            print_wrapped(console, Text.assemble(("approximate: ", "bold yellow"), caveat))
    if measured:
        console.print(
            f"{len(measured)} candidates compiled and timed on the devices at hand, ranked by their "
            "measured step (a compiled peak over the budget rejects)"
        )


def _evidence_json(found: planner.Search, item: planner.Ranked) -> dict:
    mfu = model_flops_utilisation(found, item)
    return {"mfu": mfu, "beyond_evidence": beyond_evidence(mfu, found.profile)}


def _measured_json(got) -> dict:
    if got is None:
        return {}
    return {
        "measured": {
            "step_s": got.step_s,
            "peak_bytes": got.peak_bytes,
            "compile_s": got.compile_s,
            "collective_bytes": got.collectives.total_bytes,
        }
    }


def _json(found: planner.Search, measured: dict, top: int) -> dict:
    return {
        "profile": found.profile.name,
        "memory_per_device": found.memory,
        "usable_per_device": found.usable,
        "fitting": found.fitting,
        "pruned": found.pruned,
        "workload": dataclasses.asdict(found.workload),
        "ranked": [
            {
                "mesh": r.candidate.axes,
                "hosts": r.candidate.hosts,
                "rules": r.candidate.rules_label(),
                "remat": r.candidate.remat,
                "sequence_parallel": r.candidate.sequence,
                "accumulate": r.candidate.accumulate,
                "stage_layers": list(r.candidate.split) if r.candidate.split else None,
                "context": None
                if "context" not in r.candidate.axes
                else {"size": r.candidate.axes["context"], "strategy": "ring" if r.candidate.ring else "all_gather"},
                "compute": r.candidate.compute,
                "checked": r.plan is not None,
                "estimate": r.estimate.to_json(),
                **_measured_json(measured.get(_key(r))),
                **_evidence_json(found, r),
            }
            for r in found.ranked[:top]
        ],
        "rejected": len(found.rejected),
    }
