"""`shardplan`: validate, inspect and explain plan files. Only this module turns errors into exit codes."""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback

from rich.console import Console

from shardplan.diagnostics import PlanError
from shardplan.loader import load_plan
from shardplan.schema import Plan

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
_UNREADABLE = {"unreadable-file", "unsupported-format"}

DESCRIPTION = """\
Declarative sharding plans for JAX/Flax NNX models.

A plan file (YAML or TOML) maps parameter-path regexes to PartitionSpecs on a named
device mesh. These commands check a plan against a model and show what every device
would hold, before any array is allocated.

exit status: 0 valid (warnings allowed), 1 invalid plan, 2 unreadable file or usage error
"""

EPILOG = """\
examples:
  shardplan validate plans/minigpt_dp_tp.yaml
  shardplan inspect plans/minigpt_dp_tp.yaml --device 3
  shardplan inspect plans/minigpt_fsdp.toml --json > layout.json
  shardplan explain plans/minigpt_tp.yaml transformer_blocks/0/mha/query/kernel
  shardplan schema > plan.schema.json
  shardplan auto --model minigpt_model:MiniGPT --devices 8 --memory-per-device 1GiB -o auto.yaml
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardplan", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_args(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("plan", help="plan file (.yaml, .yml or .toml)")
        sub.add_argument("--model", help="model factory module:callable (default: the plan's model.factory)")
        sub.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                         help="factory keyword argument, overriding the plan's model.config (repeatable)")
        sub.add_argument("--devices", type=int, metavar="N",
                         help="simulate N CPU devices (default without an accelerator: as many as the plan's mesh "
                              "needs, 8 for a -1 axis)")
        sub.add_argument("--debug", action="store_true", help="show Python tracebacks")

    validate = commands.add_parser("validate", help="check a plan against its model and mesh; print diagnostics")
    model_args(validate)
    validate.set_defaults(handler=_validate)

    inspect = commands.add_parser("inspect", help="show the mesh, per-parameter layout and per-device bytes")
    model_args(inspect)
    inspect.add_argument("--device", type=int, metavar="ID", help="also show which index ranges device ID holds")
    inspect.add_argument("--all-params", action="store_true",
                         help="one row per parameter (default: repeated layers share a row)")
    inspect.add_argument("--json", action="store_true", help="print the layout as JSON instead of tables")
    inspect.add_argument("--svg", metavar="FILE", help="also save the printed view as an SVG image")
    inspect.add_argument("--batch", type=int, metavar="B",
                         help="global batch (sequences) for the cost estimate (default: 4 per device)")
    inspect.add_argument("--seq", type=int, default=128, metavar="T",
                         help="tokens per sequence for the cost estimate (default 128)")
    inspect.add_argument("--profile", default="h200",
                         help="device profile for the modelled step time: h200, tpu-v5e or cpu (default h200)")
    inspect.set_defaults(handler=_inspect)

    explain = commands.add_parser("explain", help="which rule gives PATH its spec, and which rules it shadows")
    explain.add_argument("plan", help="plan file")
    explain.add_argument("path", help="parameter path, e.g. transformer_blocks/0/mha/query/kernel")
    explain.add_argument("--debug", action="store_true", help="show Python tracebacks")
    explain.set_defaults(handler=_explain)

    auto = commands.add_parser(
        "auto", help="propose a plan: enumerate meshes and rule sets, rank them by modelled step time",
        description="Recognise the model's parameter roles from its structure and shapes, enumerate\n"
                    "meshes (stage x data x model), rule sets (replicated, FSDP, Megatron,\n"
                    "vocabulary-parallel, ZeRO-1) and pipeline schedules, drop what does not validate or\n"
                    "fit the memory budget, rank the rest by the cost model's step time, print the best\n"
                    "and write the winner as a commented plan. Nothing is allocated unless --measure.",
        epilog="example:\n  shardplan auto --model minigpt_model:MiniGPT --config vocab_size=50304 --devices 8 "
               "--memory-per-device 1GiB -o auto.yaml\n  shardplan auto --model tests.models:Llama --config vocab=32000 "
               "--config dim=4096 ... --devices 64 --hosts 8 --profile h200 --memory-per-device 80GiB -o llama.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    auto.add_argument("--model", required=True, help="model factory module:callable")
    auto.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                      help="factory keyword argument (repeatable)")
    auto.add_argument("--devices", type=int, required=True, metavar="N", help="number of devices to plan for")
    auto.add_argument("--hosts", type=int, default=1, metavar="H", help="hosts the devices are spread over (default 1)")
    auto.add_argument("--memory-per-device", metavar="SIZE",
                      help="memory budget per device, e.g. 16GiB or 80GB (default: the profile's memory)")
    auto.add_argument("--batch", type=int, default=None, metavar="B",
                      help="global batch in sequences (default: 4 per device)")
    auto.add_argument("--seq", type=int, default=128, metavar="T", help="tokens per sequence (default 128)")
    auto.add_argument("--profile", default="h200", help="device profile: h200, tpu-v5e or cpu (default h200)")
    auto.add_argument("--input", default="tokens", metavar="NAME", help="name of the batch input (default tokens)")
    auto.add_argument("-o", "--output", required=True, metavar="PLAN", help="where to write the chosen plan (.yaml)")
    auto.add_argument("--top", type=int, default=8, metavar="K", help="candidates to show (default 8)")
    auto.add_argument("--measure", type=int, default=0, metavar="K",
                      help="compile the top K candidates on N simulated devices (builds the model) and re-rank "
                           "by the compiler's collective bytes and memory")
    auto.add_argument("--json", action="store_true", help="print the ranking as JSON instead of a table")
    auto.add_argument("--debug", action="store_true", help="show Python tracebacks")
    auto.set_defaults(handler=_auto)

    schema = commands.add_parser("schema", help="print the JSON Schema of the plan format")
    schema.set_defaults(handler=_schema, debug=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(record=bool(getattr(args, "svg", None)), highlight=False)
    err = Console(stderr=True, highlight=False)
    try:
        return args.handler(args, console)
    except PlanError as exc:
        from shardplan.render import render_diagnostics, render_verdict
        render_diagnostics(err, exc.diagnostics)
        if all(d.code in _UNREADABLE for d in exc.errors):
            return EXIT_USAGE
        render_verdict(err, exc.diagnostics)
        return EXIT_INVALID
    except UsageError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as exc:  # a bug of ours, not the user's: say so briefly unless --debug
        if args.debug:
            traceback.print_exc()
        else:
            err.print(f"[bold red]internal error:[/] {type(exc).__name__}: {exc}\n(rerun with --debug for the traceback)")
        return 3


class UsageError(Exception):
    """A mistake in the command line or the environment, not in the plan (exit 2)."""


def _schema(args, console: Console) -> int:
    print(json.dumps(Plan.model_json_schema(), indent=2))
    return EXIT_OK


def _validate(args, console: Console) -> int:
    from shardplan.render import render_diagnostics, render_verdict
    report = _report(args)
    render_diagnostics(console, report.diagnostics)
    render_verdict(console, report)
    return EXIT_OK if report.ok else EXIT_INVALID


def _inspect(args, console: Console) -> int:
    from shardplan import render
    order: list[str] = []
    report = _report(args, order)
    cost = _estimate(args, report, order) if report.ok else None
    if args.device is not None and args.device not in report.device_ids:
        raise UsageError(f"--device requires one of the mesh's device ids {report.device_ids}, but got {args.device}")
    if args.json:
        data = report.to_json()
        if args.device is not None:
            data["device"] = render.device_detail_json(report, args.device)
        if cost is not None:
            data["estimate"] = {"batch": cost[0].batch, "seq": cost[0].seq, "profile": cost[1].name,
                                **cost[2].to_json()}
        print(json.dumps(data, indent=2))
        return EXIT_OK if report.ok else EXIT_INVALID
    render.render_mesh(console, report)
    render.render_params(console, report, collapse=not args.all_params)
    render.render_devices(console, report)
    render.render_pipeline(console, report)
    if cost is not None:
        render.render_estimate(console, *cost)
    if args.device is not None:
        render.render_device_detail(console, report, args.device)
    render.render_diagnostics(console, report.diagnostics)
    render.render_verdict(console, report)
    if args.svg:
        console.save_svg(args.svg, title=f"shardplan inspect {args.plan}")
    return EXIT_OK if report.ok else EXIT_INVALID


def _explain(args, console: Console) -> int:
    from shardplan.matching import compile_rules, shadowing
    from shardplan.render import render_diagnostics
    from shardplan.schema import format_spec
    plan = load_plan(args.plan)
    rules, problems = compile_rules(plan)
    render_diagnostics(console, problems)
    winner, shadowed = shadowing(rules, args.path)
    if winner is None:
        console.print(f"[bold red]{args.path}[/]: no rule matches (unmatched: {plan.unmatched})")
        return EXIT_INVALID
    def named(rule) -> str:
        return f"rule #{rule.index + 1} '{rule.source}' at {plan.file}:{rule.line}"
    console.print(f"[bold]{args.path}[/] -> spec {format_spec(winner.spec)} from {named(winner)}")
    for rule in shadowed:
        console.print(f"  shadows {named(rule)} (spec {format_spec(rule.spec)})")
    if not shadowed:
        console.print("  no later rule matches this path")
    return EXIT_OK


def _auto(args, console: Console) -> int:
    from shardplan import auto as planner
    from shardplan.autorun import run_auto
    if args.devices < 1 or args.hosts < 1 or args.devices % args.hosts:
        raise UsageError(f"--devices ({args.devices}) must be a positive multiple of --hosts ({args.hosts})")
    try:
        memory = planner.parse_bytes(args.memory_per_device) if args.memory_per_device else None
        from shardplan.profiles import get_profile
        profile = get_profile(args.profile)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.measure:
        _setup_devices(args.devices, Plan.model_validate({"version": 1, "mesh": {"axes": {"data": args.devices}},
                                                          "params": [{"match": ".*", "spec": "replicated"}]}))
    from shardplan.models import ModelLoadError, parse_overrides
    try:
        config = parse_overrides(args.config)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    command = "shardplan " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["auto"] else "shardplan auto"
    return run_auto(console, factory=args.model, config=config, devices=args.devices, hosts=args.hosts,
                    memory=memory, batch=args.batch or 4 * args.devices, seq=args.seq, profile=profile,
                    input_name=args.input, output=args.output, top=args.top, measure=args.measure,
                    as_json=args.json, command=command, usage_error=UsageError)


def _report(args, order: list[str] | None = None):
    """Load the plan, set up the devices, build the model abstractly, and check."""
    plan = load_plan(args.plan)
    _setup_devices(args.devices, plan)
    order = [] if order is None else order
    model = _abstract_model(args, plan, order)
    from shardplan.report import check
    from shardplan.roles import top_level
    return check(plan, model, modules=top_level(order) or None)


def _estimate(args, report, order: list[str]):
    """(workload, profile, estimate) of the cost model for inspect."""
    from shardplan.cost import Workload, estimate
    from shardplan.profiles import get_profile
    from shardplan.roles import recognise
    try:
        profile = get_profile(args.profile)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    workload = Workload(args.batch or 4 * len(report.device_ids), args.seq)
    roles = recognise(report.params, order)
    return workload, profile, estimate(report, roles, workload, profile)


def _abstract_model(args, plan: Plan, order: list[str]):
    from shardplan.models import ModelLoadError, build_model, parse_overrides
    factory = args.model or (plan.model.factory if plan.model else None)
    if factory is None:
        raise UsageError(f"{args.plan} names no model (model.factory); pass --model module:callable")
    config = dict(plan.model.config) if plan.model and not args.model else {}
    try:
        config.update(parse_overrides(args.config))
        from shardplan.roles import definition_order
        return build_model(factory, config, on_built=lambda module: order.extend(definition_order(module)))
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None


def _setup_devices(requested: int | None, plan: Plan) -> None:
    from shardplan.devices import DeviceSetupError, has_accelerator, simulate_cpu_devices
    if requested is None and has_accelerator():
        return
    try:
        simulate_cpu_devices(requested if requested is not None else _needed_devices(plan))
    except DeviceSetupError as exc:
        raise UsageError(str(exc)) from None


def _needed_devices(plan: Plan) -> int:
    fixed = math.prod(size for size in plan.mesh.axes.values() if size != -1)
    return fixed * max(1, 8 // fixed) if -1 in plan.mesh.axes.values() else fixed


if __name__ == "__main__":
    sys.exit(main())
