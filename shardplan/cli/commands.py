"""`shardplan`: validate, inspect and explain plan files. Only this module turns errors into exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import traceback

from rich.console import Console
from rich.text import Text

from shardplan.cli.terminal import ArgumentParser, HelpFormatter, consoles, inert_streams, print_wrapped
from shardplan.plan.inert import inert
from shardplan.plan.diagnostics import PlanError
from shardplan.plan.loader import load_plan
from shardplan.plan.schema import MAX_MESH_DEVICES, Plan

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
_UNREADABLE = {"unreadable-file", "unsupported-format", "plan-too-large"}
# auto plans for as many devices as a plan may have (benchmarks/auto_scale.py: under a minute at 131,072).
MAX_AUTO_DEVICES = MAX_MESH_DEVICES

DESCRIPTION = """\
Declarative sharding plans for JAX/Flax NNX models.

A plan file (YAML or TOML) maps parameter-path regexes to PartitionSpecs on a named
device mesh. These commands check a plan against a model and show what every device
would hold, before any array is allocated.

A plan is data: its model.factory is code, imported and called only with your consent
(--model on the command line, --trust-plan, SHARDPLAN_TRUST_PLAN=1) or when it is shardplan's
own minigpt_model:MiniGPT. Without consent, validate checks what needs no model.

exit status: 0 valid (warnings allowed; validate --strict: not), 1 invalid plan, 2 unreadable file, usage error or
model not built (no consent, factory failed), 3 a bug in shardplan, 130 interrupted
"""

EPILOG = """\
examples:
  shardplan validate plans/minigpt_dp_tp.yaml
  shardplan inspect plans/minigpt_dp_tp.yaml --device 3
  shardplan inspect plans/minigpt_fsdp.toml --json > layout.json
  shardplan explain plans/minigpt_tp.yaml transformer_blocks/0/mha/query/kernel
  shardplan params --model minigpt_model:MiniGPT --config num_transformer_blocks=2
  shardplan diff plans/minigpt_dp_tp.yaml plans/minigpt_fsdp.toml
  shardplan schema > plan.schema.json
  shardplan auto --model minigpt_model:MiniGPT --devices 8 --memory-per-device 1GiB -o auto.yaml
"""


# Bounds on the workload a cost estimate is asked for: beyond them a shape-only estimate still traced
# arrays of that length (--seq 1e9: 4.2 GB) or overflowed XLA's shapes.
MAX_SEQ, MAX_BATCH = 1 << 20, 1 << 24
# Candidates `auto --measure` compiles and holds at once: their steps are timed in interleaved rounds.
MAX_MEASURED = 32


def _count(minimum: int, maximum: int | None = None):
    """argparse type: an integer in [minimum, maximum], refused with a usage message otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"requires an integer, but got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum:,}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"requires an integer {bound}, but got {value}")
        return value

    return parse


def _typed_model(sub: argparse.ArgumentParser) -> None:
    """--model (required: these commands build the model the user names) and its --config keys."""
    sub.add_argument("--model", required=True, help="model factory module:callable")
    sub.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="factory keyword argument, or a field of the config object it takes (repeatable)",
    )


def _path_and_debug(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="DIR",
        dest="import_paths",
        help="also import the model's module from DIR (repeatable; the working directory is searched too)",
    )
    sub.add_argument("--debug", action="store_true", help="show Python tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="shardplan", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_args(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("plan", help="plan file (.yaml, .yml or .toml)")
        sub.add_argument(
            "--model",
            help="model factory module:callable, imported from the installed packages or "
            "the working directory (default: the plan's model.factory, with consent); naming the plan's own "
            "factory builds it with the plan's model.config",
        )
        sub.add_argument(
            "--trust-plan",
            action="store_true",
            help="import and call the plan's model.factory (also SHARDPLAN_TRUST_PLAN=1); without it "
            "only --model or shardplan's own minigpt_model:MiniGPT is built",
        )
        sub.add_argument(
            "--config",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="factory keyword argument, or a field of the config object the factory takes, "
            "overriding the plan's model.config (repeatable)",
        )
        sub.add_argument(
            "--devices",
            type=_count(1, MAX_MESH_DEVICES),
            metavar="N",
            help="lay the plan out for N devices (default: the accelerators present, else as many as "
            "the plan's mesh needs, 8 for a -1 axis)",
        )
        sub.add_argument(
            "--eager",
            action="store_true",
            help="build the model for real on the CPU instead of abstractly (for a factory that cannot "
            "be traced, e.g. one whose submodules default to rngs=nnx.Rngs(0); tried by itself "
            "when the abstract build fails for that reason)",
        )
        _path_and_debug(sub)

    validate = commands.add_parser("validate", help="check a plan against its model and mesh; print diagnostics")
    model_args(validate)
    validate.add_argument(
        "--plan-only",
        action="store_true",
        help="check only what needs no model (rules, mesh, inputs, stages); builds nothing",
    )
    validate.add_argument(
        "--strict",
        action="store_true",
        help="warnings make the plan invalid too (exit 1): for CI jobs that check contributed plans",
    )
    validate.set_defaults(handler=_validate)

    inspect = commands.add_parser("inspect", help="show the mesh, per-parameter layout and per-device bytes")
    model_args(inspect)
    inspect.add_argument("--device", type=int, metavar="ID", help="also show which index ranges device ID holds")
    inspect.add_argument(
        "--all-params", action="store_true", help="one row per parameter (default: repeated layers share a row)"
    )
    inspect.add_argument("--json", action="store_true", help="print the layout as JSON instead of tables")
    inspect.add_argument(
        "--explain-time",
        action="store_true",
        help="also print the modelled step time term by term (weight matmuls, their kernels' fixed cost, "
        "attention, memory-bound work, pipeline bubble and ticks, each kind of collective less what runs "
        "behind compute, the optimizer update), what each is computed from, and that they add up to the "
        "step; then the peak memory per device the same way (in --json: estimate.time_explained and "
        "estimate.memory_explained)",
    )
    inspect.add_argument(
        "--svg",
        metavar="FILE",
        help="also draw the plan as an SVG picture: the mesh with each "
        "device's bytes, who holds which block of the largest "
        "arrays, and the pipeline timeline (no network needed)",
    )
    inspect.add_argument(
        "--batch",
        type=_count(1, MAX_BATCH),
        metavar="B",
        help="global batch (sequences) for the cost estimate (default: 4 per device)",
    )
    inspect.add_argument(
        "--seq",
        type=_count(1, MAX_SEQ),
        default=128,
        metavar="T",
        help="tokens per sequence for the cost estimate (default 128)",
    )
    inspect.add_argument(
        "--profile",
        default="h200",
        help="device profile for the modelled step time: a built-in name (h200, tpu-v5e, cpu) or "
        "a profile file (.yaml/.toml; see `shardplan profiles`) (default h200)",
    )
    inspect.set_defaults(handler=_inspect)

    explain = commands.add_parser("explain", help="which rule gives PATH its spec, and which rules it shadows")
    explain.add_argument("plan", help="plan file")
    explain.add_argument("path", help="parameter path, e.g. transformer_blocks/0/mha/query/kernel")
    explain.add_argument(
        "--model",
        help="also check that PATH is a parameter of this model (module:callable); "
        "without it nothing is imported and any path is explained",
    )
    explain.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="factory keyword argument for --model (repeatable)",
    )
    _path_and_debug(explain)
    explain.set_defaults(handler=_explain)

    diff = commands.add_parser(
        "diff",
        help="compare two plans for one model: specs per parameter and the bytes a reshard moves",
        description="Lay one model out under plan A and plan B on the same devices and show, per parameter\n"
        "group, the spec under each and the bytes that must move between devices to go from A\n"
        "to B (what restoring an A checkpoint under B, or resharding live, transfers): a\n"
        "device keeps what it already holds, and receives the rest of its new shard.",
        epilog="example:\n  shardplan diff plans/minigpt_dp_tp.yaml plans/minigpt_fsdp.toml",
        formatter_class=HelpFormatter,
    )
    diff.add_argument("plan", help="plan A (its model is the one compared, unless --model)")
    diff.add_argument("other", metavar="plan_b", help="plan B")
    diff.add_argument("--model", help="model factory module:callable (default: plan A's model.factory, with consent)")
    diff.add_argument("--trust-plan", action="store_true", help="import and call plan A's model.factory")
    diff.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="factory keyword argument, overriding plan A's model.config (repeatable)",
    )
    diff.add_argument(
        "--devices",
        type=_count(1, MAX_MESH_DEVICES),
        metavar="N",
        help="lay both plans out for N devices (default: what plan A's mesh needs)",
    )
    diff.add_argument("--all-params", action="store_true", help="one row per parameter")
    diff.add_argument("--json", action="store_true", help="print the comparison as JSON")
    _path_and_debug(diff)
    diff.set_defaults(handler=_diff)

    convert = commands.add_parser(
        "convert",
        help="turn EasyLM/EasyDeL rule lists and MaxText logical_axis_rules into a plan file",
        description="Read an ordered list of (regex, PartitionSpec) rules matched with re.search, first match\n"
        "wins (a Python file, read without running it, or a YAML list of [regex, spec]), and/or\n"
        "MaxText-style logical_axis_rules (YAML), and write a plan file that keeps their meaning,\n"
        "with comments saying what each rule was. Validate it against your model next.",
        epilog="example:\n  shardplan convert partition_rules.py --mesh dp=4,mp=2 --input-spec dp -o plan.yaml\n"
        "  shardplan convert --logical-rules maxtext_rules.yaml --mesh data=4,fsdp=2 -o plan.yaml",
        formatter_class=HelpFormatter,
    )
    convert.add_argument("rules", nargs="?", help="rule list: .py (EasyLM/EasyDeL style) or .yaml")
    convert.add_argument("--logical-rules", metavar="FILE", help="MaxText-style logical_axis_rules (YAML)")
    convert.add_argument("--mesh", required=True, metavar="AXIS=N,...", help="the mesh, e.g. dp=4,mp=2")
    convert.add_argument(
        "--input-spec", metavar="AXES", help="the tokens input's batch axes, e.g. dp (comma-separated)"
    )
    convert.add_argument(
        "--list",
        metavar="NAME",
        help="which rule list, when the file holds several: the class, "
        "function or YAML key it is in (e.g. LlamaConfig)",
    )
    convert.add_argument(
        "--flag",
        action="append",
        default=[],
        metavar="NAME=BOOL",
        help="the value of an argument the rule lists depend on (e.g. fully_sharded_data_parallel="
        "false); otherwise its literal default",
    )
    convert.add_argument("-o", "--output", required=True, help="plan file to write (.yaml)")
    convert.add_argument("--debug", action="store_true", help="show tracebacks")
    convert.set_defaults(handler=_convert)

    export = commands.add_parser(
        "export", help="a plan's parameter rules as (regex, PartitionSpec) pairs for re.search-based code"
    )
    export.add_argument("plan", help="plan file")
    export.add_argument("--format", choices=("python", "yaml"), default="python", help="default python")
    export.add_argument("--debug", action="store_true", help="show tracebacks")
    export.set_defaults(handler=_export)

    params = commands.add_parser(
        "params",
        help="list a model's parameter paths, shapes, bytes and roles (and a plan's rule for each)",
        description="List every parameter of a model, built abstractly (nothing is allocated): its path, shape,\n"
        "dtype, bytes and the role shardplan reads from the structure (embedding, column, row,\n"
        "matmul, bias, vector). With --plan, also the rule that matches each path and its spec.",
        epilog="example:\n  shardplan params --model minigpt_model:MiniGPT --config num_transformer_blocks=2\n"
        "  shardplan params --model minigpt_model:MiniGPT --plan plans/minigpt_tp.yaml --all-params",
        formatter_class=HelpFormatter,
    )
    _typed_model(params)
    params.add_argument("--plan", help="also show the rule of this plan that matches each path, and its spec")
    params.add_argument(
        "--all-params", action="store_true", help="one row per parameter (default: repeated layers share a row)"
    )
    params.add_argument("--json", action="store_true", help="print the list as JSON")
    _path_and_debug(params)
    params.set_defaults(handler=_params)

    auto = commands.add_parser(
        "auto",
        help="propose a plan: enumerate meshes and rule sets, rank them by modelled step time",
        description="Recognise the model's parameter roles from its structure and shapes, enumerate\n"
        "meshes (stage x data x model), rule sets (replicated, FSDP, Megatron,\n"
        "vocabulary-parallel, ZeRO-1), pipeline schedules, rematerialisation of the layers,\n"
        "sequence parallelism and gradient accumulation, drop what does not fit the memory budget less a safety\n"
        "margin, rank the rest by the cost model's step time (bounded search: what cannot\n"
        "beat the best found is not costed), check the best in full, print them and write\n"
        "the winner as a commented plan. Nothing is allocated unless --measure.",
        epilog="example:\n  shardplan auto --model minigpt_model:MiniGPT --config vocab_size=50304 --devices 8 "
        "--memory-per-device 1GiB -o auto.yaml\n  shardplan auto --model minigpt_model.llama:Llama --config vocab=32000 "
        "--config dim=4096 ... --devices 64 --hosts 8 --profile h200 --memory-per-device 80GiB -o llama.yaml",
        formatter_class=HelpFormatter,
    )
    _typed_model(auto)
    auto.add_argument(
        "--devices",
        type=_count(1, MAX_AUTO_DEVICES),
        required=True,
        metavar="N",
        help=f"number of devices to plan for (at most {MAX_AUTO_DEVICES})",
    )
    auto.add_argument(
        "--hosts",
        type=_count(1, MAX_MESH_DEVICES),
        default=1,
        metavar="H",
        help="hosts the devices are spread over (default 1)",
    )
    auto.add_argument(
        "--memory-per-device",
        metavar="SIZE",
        help="memory budget per device, e.g. 16GiB or 80GB (default: the profile's memory)",
    )
    auto.add_argument(
        "--batch",
        type=_count(1, MAX_BATCH),
        default=None,
        metavar="B",
        help="global batch in sequences (default: 4 per device)",
    )
    auto.add_argument(
        "--seq", type=_count(1, MAX_SEQ), default=128, metavar="T", help="tokens per sequence (default 128)"
    )
    auto.add_argument(
        "--profile",
        default="h200",
        help="device profile: a built-in name (h200, tpu-v5e, cpu) or a "
        "profile file (.yaml/.toml; see `shardplan profiles`) (default h200)",
    )
    auto.add_argument(
        "--compute-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype the step computes in (default: the model's own); written as `precision: compute`",
    )
    auto.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        metavar="F",
        help="expert parallelism with slots for F x the even share of routed rows per (device, expert), "
        "dropping the rest (written as `experts: dispatch: capacity`; default: dropless, whose "
        "exchange has room for every token at every expert)",
    )
    auto.add_argument(
        "--memory-margin",
        type=float,
        default=None,
        metavar="SHARE",
        help="share of the memory budget left free for what the memory model does not count "
        "(default 0.2: its largest measured under-estimate, 18%%, plus slack)",
    )
    auto.add_argument("--input", default="tokens", metavar="NAME", help="name of the batch input (default tokens)")
    auto.add_argument("-o", "--output", required=True, metavar="PLAN", help="where to write the chosen plan (.yaml)")
    auto.add_argument("--top", type=_count(1), default=8, metavar="K", help="candidates to show (default 8)")
    auto.add_argument(
        "--measure",
        type=_count(0),
        default=0,
        metavar="K",
        help="compile the top K candidates and time a few steps of each on the devices at hand "
        "(N simulated CPU devices without an accelerator; builds the model; the K candidates' "
        "states are held together, as their steps are timed in turn), print modelled against "
        f"measured, and write the measured fastest (at most {MAX_MEASURED})",
    )
    auto.add_argument(
        "--measure-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds one candidate may take to build, trace and compile under --measure (default 300); "
        "one past it is reported and skipped, and the search goes on",
    )
    auto.add_argument(
        "--calibrate",
        metavar="PROFILE",
        default=None,
        help="with --measure: refit the profile's compute and link rates to the timed steps and "
        "write the refitted profile to PROFILE (.yaml), saying what moved and by how much",
    )
    auto.add_argument("--json", action="store_true", help="print the ranking as JSON instead of a table")
    _path_and_debug(auto)
    auto.set_defaults(handler=_auto)

    calibrate = commands.add_parser(
        "calibrate",
        help="measure a device profile on the devices at hand and write it as a profile file",
        description="Time, with every device working at once, what the cost model turns work into time\n"
        "with: matmuls over a transformer's shapes as the forward and both gradients run them (rate\n"
        "and per-kernel overhead), each kind of collective over the devices (and, one process per\n"
        "host with --coordinator, the hosts) for bandwidth and latency, attention, and a reference\n"
        "GPT's training step, for the rate a step runs its memory-bound work at (norms, softmax,\n"
        "activations, the update) beside all the above.\n"
        "Writes a profile file for --profile of `auto` and `inspect` that says what was measured,\n"
        "how and when. Without an accelerator it measures N simulated CPU devices (they share\n"
        "the cores).",
        epilog="example:\n  shardplan calibrate -o measured.yaml\n"
        "  shardplan auto --model minigpt_model:MiniGPT --devices 8 --profile measured.yaml --measure 8 "
        "-o auto.yaml",
        formatter_class=HelpFormatter,
    )
    calibrate.add_argument(
        "-o", "--output", required=True, metavar="PROFILE", help="where to write the profile (.yaml)"
    )
    calibrate.add_argument(
        "--devices",
        type=_count(1, 64),
        default=None,
        metavar="N",
        help="simulated CPU devices to measure when there is no accelerator (default 8)",
    )
    calibrate.add_argument("--name", default="measured", help="the profile's name (default measured)")
    calibrate.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype of the timed work (default: float32 on CPU, bfloat16 on accelerators)",
    )
    calibrate.add_argument("--quick", action="store_true", help="fewer shapes (about half the time)")
    calibrate.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="one process per host: join the run whose process 0 listens at HOST:PORT (also read "
        "from JAX_COORDINATOR_ADDRESS; under SLURM or Open MPI all three are detected), "
        "to measure the links between hosts too; process 0 writes the profile",
    )
    calibrate.add_argument("--num-processes", type=_count(1), metavar="N", help="processes in the run")
    calibrate.add_argument("--process-id", type=_count(0), metavar="I", help="this process's index, 0..N-1")
    calibrate.add_argument("--debug", action="store_true", help="show Python tracebacks")
    calibrate.set_defaults(handler=_calibrate)

    profiles = commands.add_parser(
        "profiles",
        help="list the built-in device profiles, or check and show a profile file",
        description="A device profile holds the numbers the cost model turns bytes and FLOPs into time\n"
        "with: peak FLOP/s (per dtype), memory, memory and link bandwidths, devices per host,\n"
        "collective latency and the shares of peak a large matmul and a large collective reach.\n"
        "Describe your own hardware in a YAML or TOML file and pass it as --profile FILE to\n"
        "`auto` and `inspect`; `shardplan schema --profile` prints its JSON Schema.",
        epilog="example profile file (profiles/a100-80gb-selene.yaml holds a complete one):\n"
        "  name: my-a100\n  peak_flops: 312e12\n  memory_bytes: 80GiB\n  memory_bandwidth: 2.0e12\n"
        "  intra_host_bandwidth: 300e9\n  inter_host_bandwidth: 25e9\n  devices_per_host: 8\n\n"
        "example:\n  shardplan profiles\n  shardplan profiles profiles/a100-80gb-selene.yaml",
        formatter_class=HelpFormatter,
    )
    profiles.add_argument("file", nargs="?", help="a profile file to check and show")
    profiles.add_argument("--json", action="store_true", help="print the profiles as JSON")
    profiles.set_defaults(handler=_profiles, debug=False)

    schema = commands.add_parser(
        "schema",
        help="print the JSON Schema of the plan format",
        description="Print the JSON Schema of plan format version 1, generated from shardplan's own plan\n"
        "models, for editors that complete and check YAML/TOML plan files (e.g. the YAML\n"
        "language server: `# yaml-language-server: $schema=plan.schema.json`). Rules JSON\n"
        "Schema cannot express (at most one -1 axis, regex validity, everything about the\n"
        "model) are checked by `shardplan validate`.",
        epilog="example:\n  shardplan schema > plan.schema.json",
        formatter_class=HelpFormatter,
    )
    schema.add_argument("--profile", action="store_true", help="the schema of device profile files instead")
    schema.set_defaults(handler=_schema, debug=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    # The planner and the checks make many small objects that live to the end: with Python's default
    # thresholds the collector walks them again and again (`auto` of a 70B-class model for 16,384
    # devices: 45 s, 35 s with these).
    gc.set_threshold(50_000, 50, 100)
    from shardplan.processes.interrupts import interrupt_once

    with interrupt_once(), inert_streams():  # input text never drives the terminal, whatever prints it
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # markup=False: plan text (regexes such as `[a-z]+`) and messages are printed as they are.
    console, err = consoles()
    try:
        return args.handler(args, console)
    except PlanError as exc:
        from shardplan.cli.render import render_diagnostics, render_verdict

        render_diagnostics(err, exc.diagnostics)
        if all(d.code in _UNREADABLE for d in exc.errors):
            return EXIT_USAGE
        render_verdict(err, exc.diagnostics)
        return EXIT_INVALID
    except UsageError as exc:
        print_error(err, str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug of ours, not the user's
        return report_bug(err, exc, debug=args.debug, program="shardplan")


def print_error(console: Console, message: str, label: str = "error") -> None:
    """The message wrapped at the console's width, its continuation lines indented."""
    print_wrapped(console, Text.assemble((f"{label}: ", "bold red"), inert(message)))


def report_bug(console: Console, exc: BaseException, *, debug: bool, program: str) -> int:
    """Exit status 3 is only ever a bug of ours: say so, and how to report it."""
    if debug:
        traceback.print_exc()
    print_error(console, f"{type(exc).__name__}: {exc}", label=f"internal error (a bug in {program})")
    print_wrapped(
        console,
        f"Please report it with the command line you ran and the output of the same command with "
        f"--debug{'' if debug else ' (which adds the traceback)'}.",
    )
    return EXIT_BUG


class UsageError(Exception):
    """A mistake in the command line or the environment, not in the plan (exit 2)."""


class ModelNotBuilt(UsageError):
    """No model to check against: the plan names none, or names a factory the user has not agreed to run."""


def _writable(output: str, *, make_folder: bool = False) -> None:
    """Refuse an output path that cannot be written, before any work is done for it."""
    import os
    from pathlib import Path

    path = Path(output)
    if path.is_dir():
        raise UsageError(f"cannot write {output}: it is a directory")
    folder = path.parent
    while make_folder and not folder.exists() and folder != folder.parent:
        folder = folder.parent  # (the folders are made when it is written)
    if not folder.is_dir():
        raise UsageError(f"cannot write {output}: there is no folder {path.parent}")
    if not (os.access(path, os.W_OK) if path.exists() else os.access(folder, os.W_OK | os.X_OK)):
        raise UsageError(f"cannot write {output}: permission denied (or a read-only file system)")


def _write_output(output: str, text: str) -> None:
    from pathlib import Path

    try:
        Path(output).write_text(text)
    except OSError as exc:
        raise UsageError(f"cannot write {output}: {exc.strerror or exc}") from None


def _convert(args, console: Console) -> int:
    from pathlib import Path

    from shardplan.review.report import check_plan_only
    from shardplan.plan.convert import ConvertError, pick, plan_text, read_logical_rules, rule_lists
    from shardplan.plan.loader import MAX_PLAN_BYTES, FileTooLarge, parse_plan, read_bounded

    def read(name: str) -> str:
        return read_bounded(Path(name), MAX_PLAN_BYTES).decode("utf-8", errors="replace")

    if not args.rules and not args.logical_rules:
        raise UsageError("give a rule list, --logical-rules, or both")
    _writable(args.output)
    if (args.list or args.flag) and not args.rules:
        raise UsageError(
            "--list and --flag choose among the lists of a rule file; give one (they do not apply to --logical-rules)"
        )
    mesh = _mesh_argument(args.mesh)
    flags = dict(_flag_argument(flag) for flag in args.flag)
    chosen, how = None, ""
    try:
        if args.rules:
            fmt = "python" if args.rules.endswith(".py") else "yaml"
            chosen, how = pick(rule_lists(read(args.rules), fmt, args.rules), args.rules, choose=args.list, flags=flags)
        logical = read_logical_rules(read(args.logical_rules), args.logical_rules) if args.logical_rules else None
    except (ConvertError, OSError, FileTooLarge) as error:
        raise UsageError(str(error)) from None
    source = args.rules or args.logical_rules
    text = inert(
        plan_text(
            chosen.rules if chosen else [],
            mesh,
            source=source,
            input_spec=[args.input_spec.split(",") if "," in args.input_spec else args.input_spec, None]
            if args.input_spec
            else None,
            logical=logical,
            logical_source=args.logical_rules,
        )
    )
    try:  # what we write must be a plan that validates (everything that needs no model)
        plan = parse_plan(text, file=args.output)
        problems = [d for d in check_plan_only(plan, _device_count(None, plan)) if d.severity == "error"]
    except PlanError as error:
        problems = error.errors
    if problems:
        raise PlanError([_in_source(d, source, chosen) for d in problems])
    _write_output(args.output, text)
    what = (
        f" from {chosen.where}" + (f" ({how})" if how else "")
        if chosen and chosen.where not in ("<module>", "<list>")
        else ""
    )
    count = len(plan.params)
    console.print(
        f"wrote {args.output}: {count} rule{'' if count == 1 else 's'}{what} over mesh {mesh}; check it with "
        f"`shardplan validate {args.output} --model ...`"
    )
    return EXIT_OK


def _in_source(diagnostic, source: str, chosen):
    """A diagnostic of the converted plan, told where its rule came from (nothing was written)."""
    import dataclasses

    line = (
        chosen.lines[diagnostic.rule]
        if chosen and diagnostic.rule is not None and diagnostic.rule < len(chosen.lines)
        else None
    )
    return dataclasses.replace(
        diagnostic,
        file=source,
        line=line,
        column=None,
        message=f"{diagnostic.message} (converting {source}: nothing was written)",
    )


def _flag_argument(text: str) -> tuple[str, bool]:
    name, _, value = text.partition("=")
    if not name or value.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise UsageError(
            f"--flag takes NAME=true or NAME=false (e.g. fully_sharded_data_parallel=false), but got {text!r}"
        )
    return name, value.lower() in ("true", "1", "yes")


def _mesh_argument(text: str) -> dict[str, int]:
    mesh = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise UsageError(f"--mesh takes AXIS=N pairs separated by commas (e.g. dp=4,mp=2), but got {text!r}")
        mesh[name.strip()] = int(size)
    return mesh


def _export(args, console: Console) -> int:
    from shardplan.plan.convert import export_rules

    print(export_rules(load_plan(args.plan), args.format), end="")
    return EXIT_OK


def _schema(args, console: Console) -> int:
    from shardplan.planner.profiles import ProfileFile

    print(json.dumps((ProfileFile if args.profile else Plan).model_json_schema(), indent=2))
    return EXIT_OK


def _profiles(args, console: Console) -> int:
    import dataclasses

    from shardplan.cli.render import render_profiles
    from shardplan.planner.profiles import PROFILES, load_profile

    shipped = [] if args.file else shipped_profile_files()
    shown = [load_profile(args.file)] if args.file else list(PROFILES.values()) + [load_profile(f) for f in shipped]
    if args.json:
        print(json.dumps([dataclasses.asdict(p) for p in shown], indent=2))
    else:
        render_profiles(console, shown)
        if shipped:
            print_wrapped(
                console,
                f"profile files shipped in {shipped[0].parent}: {', '.join(f.name for f in shipped)} "
                "(pass the file's path as --profile; `shardplan calibrate` writes one for the devices at hand)",
            )
    return EXIT_OK


def shipped_profile_files() -> list:
    """The profile files the project ships (`profiles/` beside the package, in a checkout), by name."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "profiles"
    if not folder.is_dir():
        return []
    if folder.is_relative_to(Path.cwd()):  # as the user would type it
        folder = folder.relative_to(Path.cwd())
    return sorted(folder.glob("*.yaml"))


def _calibrate(args, console: Console) -> int:
    from shardplan.cli.render import render_profiles
    from shardplan.compose.calibrate import calibrate, profile_text
    from shardplan.processes.devices import has_accelerator

    if not args.output.lower().endswith((".yaml", ".yml")):
        raise UsageError(f"calibrate writes a YAML profile; name the output .yaml or .yml, not {args.output!r}")
    _writable(args.output, make_folder=True)
    if args.devices is not None or not has_accelerator():
        _setup_devices(
            args.devices or 8,
            Plan.model_validate(
                {"version": 1, "mesh": {"axes": {"data": 1}}, "params": [{"match": ".*", "spec": "replicated"}]}
            ),
        )
    from shardplan.processes.distributed import initialize

    initialize(coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    import jax

    with console.status("calibrating") as status:
        found = calibrate(
            name=args.name,
            dtype=args.dtype,
            quick=args.quick,
            progress=lambda what: status.update(f"calibrating: {what}"),
        )
    unmeasured = (
        [
            "inter_host_bandwidth (one process: written as a quarter of the links inside the host; run one "
            "process per host with --coordinator to measure it)"
        ]
        if found.processes == 1
        else []
    )
    if found.devices == 1:
        unmeasured.append("collectives (one device)")
    if found.reference is None:
        unmeasured.append(
            "the rate of a step's memory-bound work and a pipeline tick's cost (the reference steps failed: "
            f"{found.reference_failure}; memory_bandwidth is one elementwise pass's, an upper bound)"
        )
    if jax.process_index() != 0:
        return EXIT_OK  # (every process measures; the first writes)
    from shardplan.cli.autorun import _write_atomically
    from pathlib import Path

    try:
        _write_atomically(Path(args.output), profile_text(found, unmeasured=unmeasured))
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    render_profiles(console, [found.profile])
    print_wrapped(console, f"measured in {found.seconds:.0f} s; wrote {args.output}")
    for what in unmeasured:
        print_wrapped(console, f"not measured: {what}")
    return EXIT_OK


def _validate(args, console: Console) -> int:
    from shardplan.cli.render import render_diagnostics, render_verdict

    if args.plan_only:
        return _validate_plan_only(args, console)
    try:
        report = _report(args)
    except ModelNotBuilt as exc:
        # Validating a plan from someone else must be safe: check what needs no model, build nothing.
        code = _validate_plan_only(args, console)
        print_error(consoles()[1], str(exc), label="not checked against the model")
        return code if code == EXIT_INVALID else EXIT_USAGE
    render_diagnostics(console, report.diagnostics)
    render_verdict(console, report)
    _render_assumed(console, args, report.plan, len(report.device_ids))
    return _validate_exit(args, report.diagnostics)


def _validate_plan_only(args, console: Console) -> int:
    from shardplan.cli.render import render_diagnostics, render_verdict
    from shardplan.review.report import check_plan_only

    plan = load_plan(args.plan)
    devices = _device_count(args.devices, plan)
    diagnostics = check_plan_only(plan, devices)
    render_diagnostics(console, diagnostics)
    render_verdict(console, diagnostics, scope="plan only, without the model")
    _render_assumed(console, args, plan, devices)
    return _validate_exit(args, diagnostics)


def _validate_exit(args, diagnostics) -> int:
    worst = {"error"} | ({"warning"} if getattr(args, "strict", False) else set())
    return EXIT_INVALID if any(d.severity in worst for d in diagnostics) else EXIT_OK


def _render_assumed(console: Console, args, plan: Plan, devices: int) -> None:
    """What the verdict took for granted: the device count, and a batch split no shape lets it check."""
    if args.devices is None:
        print_wrapped(
            console, f"checked for {devices} devices, as the plan's mesh needs (--devices N checks another count)"
        )
    count = plan.pipeline.microbatches if plan.pipeline is not None else plan.accumulate
    if count > 1 and not any(isinstance(spec, dict) or getattr(spec, "shape", None) for spec in plan.inputs.values()):
        what = "microbatches" if plan.pipeline is not None else "accumulated microbatches (accumulate)"
        print_wrapped(
            console,
            f"not checked: the batch must split into {count} {what} on every data shard; the "
            "inputs give no shape, so it is checked when a batch is sharded (shard_inputs); "
            "give one, e.g. tokens: {spec: [data, null], shape: [32, 128]}",
        )


def _inspect(args, console: Console) -> int:
    from shardplan.cli import render

    report, cost = inspected(args)
    if args.json:
        data = report.to_json()
        if args.device is not None and report.devices:
            data["device"] = render.device_detail_json(report, args.device)
        if cost is not None:
            data["estimate"] = {
                "batch": cost.workload.batch,
                "seq": cost.workload.seq,
                "profile": cost.profile.name,
                **cost.estimate.to_json(),
                "code_keeps": dataclasses.asdict(cost.code),
            }
        print(json.dumps(data, indent=2))
        return EXIT_OK if report.ok else EXIT_INVALID
    render_inspect(
        console, report, cost, device=args.device, all_params=args.all_params, explain_time=args.explain_time
    )
    if args.svg:
        from shardplan.cli.picture import render_svg

        try:
            with open(args.svg, "w", encoding="utf-8") as handle:
                handle.write(render_svg(report))
        except OSError as exc:
            raise UsageError(f"cannot write --svg {args.svg}: {exc.strerror or exc}") from None
        console.print(f"drew {args.svg}")
    return EXIT_OK if report.ok else EXIT_INVALID


def inspected(args):
    """(report, estimate or None) of `shardplan inspect ARGS`: the plan checked against the model, and
    the cost model's figures where it is valid."""
    order: list[str] = []
    report, model, deep = _checked_model(args, order)
    if report.ok:  # the estimate's batch must split as the plan's microbatches do
        from dataclasses import replace

        from shardplan.pipeline.stages import check_microbatches
        from shardplan.core.validate import data_axes

        found = check_microbatches(report.plan, _batch(args, report), report.axes, data_axes(report.plan, report.axes))
        report = replace(report, diagnostics=report.diagnostics + found)
    if args.device is not None and args.device not in report.device_ids:  # (before the estimate's work)
        raise UsageError(f"--device requires one of the mesh's device ids {report.device_ids}, but got {args.device}")
    return report, (_estimate(args, report, order, model, deep) if report.ok else None)


def render_inspect(
    console: Console,
    report,
    cost,
    *,
    device: int | None = None,
    all_params: bool = False,
    explain_time: bool = False,
) -> None:
    """What `inspect` prints: the summary first (mesh, per-device totals, pipeline, estimate), then the
    tables and the diagnostics."""
    from shardplan.cli import render

    render.render_mesh(console, report)
    render.render_context(console, report)
    render.render_devices(console, report)
    render.render_pipeline(console, report)
    render.render_experts(console, report, cost.estimate if cost is not None else None)
    if cost is not None:
        render.render_estimate(
            console,
            cost.workload,
            cost.profile,
            cost.estimate,
            accumulate=report.plan.accumulate,
            code=cost.code,
            evened=_evened_stages(report, cost.estimate),
        )
        if explain_time:
            render.render_time_terms(console, cost.profile, cost.estimate)
    elif explain_time:  # (asked for, and nothing to show: say why rather than leave it out)
        from shardplan.cli.terminal import print_wrapped

        print_wrapped(
            console,
            "--explain-time: no modelled step for a plan with errors (below); the cost model needs a plan that checks",
        )
    render.render_params(console, report, collapse=not all_params)
    if device is not None and report.devices:  # no per-device layout when the mesh does not fit
        render.render_device_detail(console, report, device, collapse=not all_params)
    render.render_diagnostics(console, report.diagnostics)
    render.render_verdict(console, report)


def _explain(args, console: Console) -> int:
    from shardplan.plan.matching import compile_rules, shadowing
    from shardplan.cli.render import render_diagnostics
    from shardplan.plan.schema import format_spec

    plan = load_plan(args.plan)
    rules, problems = compile_rules(plan)
    render_diagnostics(console, problems)
    params = []
    if args.model:
        params = _model_params(args.model, args.config, paths=args.import_paths)
        paths = [p.path for p in params]
        if args.path not in paths:
            import difflib

            close = difflib.get_close_matches(args.path, paths, n=3, cutoff=0.6)
            hint = (
                f"; did you mean {' or '.join(repr(c) for c in close)}?"
                if close
                else f"; `shardplan params --model {args.model}` lists its {len(paths)} paths"
            )
            print_error(console, f"{args.path} is not a parameter of {args.model}{hint}")
            return EXIT_INVALID
    winner, shadowed = shadowing(rules, args.path)
    if winner is None:
        console.print(Text.assemble((args.path, "bold red"), f": no rule matches (unmatched: {plan.unmatched})"))
        return EXIT_INVALID

    def named(rule) -> str:
        return f"rule #{rule.index + 1} '{rule.source}' at {plan.file}:{rule.line}"

    console.print(Text.assemble((args.path, "bold"), f" -> spec {format_spec(winner.spec)} from {named(winner)}"))
    written = plan.written_spec("params", winner.index)
    if written is not None and plan.logical_rules:
        from shardplan.plan.logical import resolve

        _, given = resolve(written, plan.logical_rules, plan.mesh.axes)
        taken = [
            f"{entry}: "
            + (
                f"logical rule #{k + 1} {list(plan.logical_rules[k])}"
                if k is not None
                else "no rule takes it (not split)"
            )
            for entry, k in zip(written, given)
            if isinstance(entry, str) and entry not in plan.mesh.axes
        ]
        console.print(f"  written {written} in logical names; per array, as flax resolves them: {'; '.join(taken)}")
    elif written is not None:
        names = [n for entry in written for n in ([entry] if isinstance(entry, str) else entry or [])]
        mapped = ", ".join(
            f"{n}: {plan.logical_axes[n] if plan.logical_axes.get(n) is not None else 'null'}"
            for n in dict.fromkeys(names)
            if n in plan.logical_axes
        )
        console.print(f"  written {written} in logical names; logical_axes maps {mapped}")
    for rule in shadowed:
        console.print(f"  shadows {named(rule)} (spec {format_spec(rule.spec)})")
    if not shadowed:
        console.print("  no later rule matches this path")
    if plan.experts is not None and params:
        print_wrapped(console, _expert_role_text(plan, params, args.path))
    return EXIT_OK


def _expert_role_text(plan, params, path: str) -> str:
    """Why `path` is (or is not) an expert stack of the plan's MoE blocks."""
    from shardplan.experts.check import expert_blocks

    roles, _ = expert_blocks(plan, params)
    shapes = {p.path: p.shape for p in params}
    for r in roles:
        if path in r.experts:
            size = plan.mesh.axes.get(plan.experts.axis)
            share = f"; experts.axis {plan.experts.axis!r}" + (
                f" ({size} devices) gives each device {r.count // size} of them"
                if size and size > 0 and r.count % size == 0
                else ""
            )
            return (
                f"  expert-stacked: dim 0 of {shapes[path]} is the {r.count} experts of MoE block {r.block!r}, "
                f"whose router {r.router} {shapes[r.router]} scores {r.count} of them (a 3-D weight of the "
                f"block whose leading dim is the router's width){share}"
            )
        if path == r.router:
            return (
                f"  the router of MoE block {r.block!r}: it scores its {r.count} experts; every device holds it whole"
            )
    return "  not an expert weight of the plan's MoE blocks"


def _model_params(factory: str, config_pairs: list[str], order: list[str] | None = None, paths=()):
    """Parameter infos of the model `factory` builds abstractly (the user typed it: consent)."""
    from shardplan.model.factory import ModelLoadError, build_model, parse_overrides
    from shardplan.core.paths import param_infos
    from shardplan.core.roles import definition_order

    order = [] if order is None else order
    try:
        model = build_model(
            factory,
            parse_overrides(config_pairs),
            paths=tuple(paths),
            notice=_notice,
            on_built=lambda module: order.extend(definition_order(module)),
        )
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    return param_infos(model)


def _params(args, console: Console) -> int:
    from shardplan.cli.render import params_json, render_param_list
    from shardplan.core.roles import recognise

    order: list[str] = []
    params = _model_params(args.model, args.config, order, paths=args.import_paths)
    roles = recognise(params, order)
    rules, errors = None, []
    if args.plan:
        from shardplan.review.report import check_params
        from shardplan.cli.render import render_diagnostics
        from shardplan.plan.matching import compile_rules

        plan = load_plan(args.plan)
        rules, _ = compile_rules(plan)
        report = check_params(plan, params, list(range(_device_count(None, plan))))
        errors = report.errors  # what each spec means on this model: a dim its axes do not divide, ...
    if args.json:
        print(json.dumps(params_json(params, roles, rules), indent=2))
    else:
        render_param_list(console, params, roles, rules, collapse=not args.all_params)
    if errors:
        render_diagnostics(console if not args.json else consoles()[1], errors)
        return EXIT_INVALID
    return EXIT_OK


def _diff(args, console: Console) -> int:
    from shardplan.review.diff import layout_diff
    from shardplan.core.paths import param_infos
    from shardplan.cli.render import render_diagnostics, render_diff
    from shardplan.review.report import check_params

    plan_a, plan_b = load_plan(args.plan), load_plan(args.other)
    order: list[str] = []
    params = param_infos(_abstract_model(args, plan_a, order))
    devices = list(range(_device_count(args.devices, plan_a)))
    reports = [check_params(plan, params, devices) for plan in (plan_a, plan_b)]
    errors = [d for report in reports for d in report.errors]
    if errors:
        render_diagnostics(console, errors)
        return EXIT_INVALID
    changes = layout_diff(*reports)
    if args.json:
        from shardplan.review.report import spec_json

        print(
            json.dumps(
                {
                    "devices": len(devices),
                    "params": [
                        {
                            "path": c.path,
                            "spec_a": spec_json(c.spec_a),
                            "spec_b": spec_json(c.spec_b),
                            "param_bytes_moved": c.param_bytes_moved,
                            "opt_bytes_moved": c.opt_bytes_moved,
                        }
                        for c in changes
                    ],
                },
                indent=2,
            )
        )
        return EXIT_OK
    render_diff(console, changes, args.plan, args.other, len(devices), collapse=not args.all_params)
    return EXIT_OK


def _auto(args, console: Console) -> int:
    from shardplan.cli.autorun import AutoRequest, run_auto

    if args.devices % args.hosts:
        raise UsageError(f"--devices ({args.devices}) must be a positive multiple of --hosts ({args.hosts})")
    if not args.output.lower().endswith((".yaml", ".yml")):
        raise UsageError(f"auto writes a YAML plan; name the output .yaml or .yml, not {args.output!r}")
    _writable(args.output, make_folder=True)  # before the search, not after it
    if args.memory_margin is not None and not 0 <= args.memory_margin < 1:
        raise UsageError(f"--memory-margin is a share of the budget in [0, 1), but got {args.memory_margin}")
    if args.capacity_factor is not None and not 0 < args.capacity_factor <= 64:
        raise UsageError(
            f"--capacity-factor is a multiple of the even share in (0, 64] (as the plan's "
            f"`experts: capacity_factor`), but got {args.capacity_factor}"
        )
    if args.measure > MAX_MEASURED:
        raise UsageError(
            f"--measure requires at most {MAX_MEASURED} candidates, but got {args.measure}: each one's compiled "
            "step and state are held until all are timed in turn (the model ranks the rest)"
        )
    if not 0 < args.measure_timeout <= 86_400:
        raise UsageError(f"--measure-timeout requires seconds in (0, 86400], but got {args.measure_timeout}")
    if args.measure and args.devices > 64:
        raise UsageError(
            f"--measure compiles every candidate on {args.devices} simulated CPU devices; "
            "measure with at most 64 (the ranking without --measure needs no devices)"
        )
    try:
        from shardplan.planner.profiles import get_profile, parse_bytes

        memory = parse_bytes(args.memory_per_device) if args.memory_per_device else None
        profile = get_profile(args.profile)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.calibrate is not None:
        if not args.measure:
            raise UsageError("--calibrate refits the profile to measured steps: give --measure K as well")
        if not args.calibrate.lower().endswith((".yaml", ".yml")):
            raise UsageError(f"--calibrate writes a YAML profile; name it .yaml or .yml, not {args.calibrate!r}")
        _writable(args.calibrate, make_folder=True)
        if os.path.realpath(args.calibrate) == os.path.realpath(args.output):
            raise UsageError(
                f"--calibrate and -o both name {args.output}: one would overwrite the other; give two files"
            )
    if args.measure:
        _setup_devices(
            args.devices,
            Plan.model_validate(
                {
                    "version": 1,
                    "mesh": {"axes": {"data": args.devices}},
                    "params": [{"match": ".*", "spec": "replicated"}],
                }
            ),
        )
    from shardplan.model.factory import ModelLoadError, parse_overrides

    try:
        config = parse_overrides(args.config)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    command = "shardplan " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["auto"] else "shardplan auto"
    request = AutoRequest(
        factory=args.model,
        config=config,
        devices=args.devices,
        hosts=args.hosts,
        memory=memory,
        batch=args.batch or 4 * args.devices,
        seq=args.seq,
        profile=profile,
        input_name=args.input,
        output=args.output,
        top=args.top,
        measure=args.measure,
        measure_timeout=args.measure_timeout,
        compute=args.compute_dtype,
        margin=args.memory_margin,
        capacity=args.capacity_factor,
        as_json=args.json,
        command=command,
        paths=tuple(args.import_paths),
        refit_to=args.calibrate,
    )
    return run_auto(console, request, UsageError)


def _report(args, order: list[str] | None = None):
    """Load the plan, build the model abstractly (with consent), and check it for the devices."""
    return _checked_model(args, [] if order is None else order)[0]


def _checked_model(args, order: list[str]):
    """(report, abstract model): the plan checked against the model for the devices.

    Without an accelerator (or with --devices) the layout is computed for N virtual devices:
    no JAX devices are needed to lay a plan out, so none are simulated.
    """
    plan = load_plan(args.plan)
    from shardplan.processes.devices import has_accelerator
    from shardplan.core.paths import param_infos
    from shardplan.review.report import check_params
    from shardplan.compose.check import check, with_model_checks
    from shardplan.core.roles import recognise

    if args.devices is None and has_accelerator():
        model = _abstract_model(args, plan, order)
        return check(plan, model, roles=recognise(param_infos(model), order) if plan.context else None), model, None
    deep = _deep_model(args, plan, order)
    model = deep.shallow if deep else _abstract_model(args, plan, order)
    report = check_params(
        plan, deep.params if deep else param_infos(model), list(range(_device_count(args.devices, plan)))
    )
    # the order the build recorded: the abstract model's state is sorted by name
    roles = recognise(param_infos(model), deep.shallow_order if deep else order) if plan.context else None
    return with_model_checks(report, plan, model, roles=roles), model, deep


def _batch(args, report) -> int:
    """inspect's global batch: --batch, or 4 sequences per device."""
    return args.batch or 4 * len(report.device_ids)


def _evened_stages(report, cost):
    """(layers per stage, modelled compute of the slowest) of a split that evens out the plan's stages,
    where its schedule lets a shorter stage skip its padding and the gain is worth saying; else None."""
    from shardplan.pipeline.schedules import padding_skipped
    from shardplan.planner.auto import evened_out

    stage_map, plan = report.stage_map, report.plan
    split_sequence = plan.context is not None and report.axes.get(plan.context.axis, 1) > 1
    if (
        stage_map is None
        or not cost.stage_compute_s
        or not padding_skipped(plan.pipeline.schedule, stage_map.virtual, split_sequence)
    ):
        return None
    return evened_out(len(stage_map.stage_of), stage_map.stages, cost)


@dataclasses.dataclass(frozen=True)
class _InspectCost:
    workload: object  # shardplan.planner.cost.Workload
    profile: object  # shardplan.planner.profiles.Profile
    estimate: object  # shardplan.planner.cost.Estimate
    code: object  # what the model's code keeps (shardplan.planner.kept)


def _estimate(args, report, order: list[str], model, deep=None) -> _InspectCost:
    """The cost model's figures for inspect; a deep model's code is traced at its shallow depth (the
    residuals per layer are the same)."""
    from shardplan.planner.cost import Workload, estimate
    from shardplan.planner.kept import with_code
    from shardplan.planner.profiles import get_profile
    from shardplan.core.roles import recognise
    from shardplan.core.paths import param_infos

    try:
        profile = get_profile(args.profile)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    workload = Workload(_batch(args, report), args.seq)
    roles = recognise(report.params, order)
    infos = param_infos(model)
    traced = recognise(infos, deep.shallow_order) if deep else roles
    code = with_code(
        traced, model, workload.seq, input_name=next(iter(report.plan.inputs), "tokens"), params=infos
    ).code
    roles = dataclasses.replace(roles, code=code)
    return _InspectCost(workload, profile, estimate(report, roles, workload, profile, per_stage=True), roles.code)


def _deep_model(args, plan: Plan, order: list[str]):
    """The model read from shallow builds when a config key sets a large depth (see `model/depth.py`), else None."""
    from shardplan.model.depth import read_deep

    factory, config = _factory_and_config(args, plan)

    def build(probe_config: dict, probe_order: list[str]):
        from shardplan.pipeline.stacked import pipeline_layers_of

        return pipeline_layers_of(plan, _build(args, factory, probe_config, probe_order), in_place=True)

    from shardplan.model.factory import ModelLoadError

    try:
        deep = read_deep(build, config)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    if deep is not None:
        order.extend(deep.order)
    return deep


def _abstract_model(args, plan: Plan, order: list[str]):
    from shardplan.pipeline.stacked import pipeline_layers_of

    factory, config = _factory_and_config(args, plan)
    return pipeline_layers_of(plan, _build(args, factory, config, order), in_place=True)


def _factory_and_config(args, plan: Plan) -> tuple[str, dict]:
    """The model the command builds (with consent) and its config, the plan's with --config over it."""
    from shardplan.model.factory import ModelLoadError, consented, parse_overrides

    factory = args.model or (plan.model.factory if plan.model else None)
    if factory is None:
        raise ModelNotBuilt(f"{args.plan} names no model (model.factory); pass --model module:callable")
    if not consented(factory, typed=bool(args.model), trust_flag=args.trust_plan):
        raise ModelNotBuilt(
            f"the plan's model.factory {factory!r} is code, and plans are data: nothing was run. "
            "If you know that code and want it run, pass --trust-plan (or set SHARDPLAN_TRUST_PLAN=1); "
            "otherwise name the model you mean yourself with --model module:callable, or check only "
            "what needs no model with --plan-only"
        )
    # (--model naming the plan's own factory is consent to build it, as `auto`'s written plans suggest:
    # the plan's config still applies; another factory is another model, whose config the plan cannot know)
    same = plan.model is not None and args.model in (None, plan.model.factory)
    config = dict(plan.model.config) if same else {}
    try:
        config.update(parse_overrides(args.config))
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    return factory, config


def _build(args, factory: str, config: dict, order: list[str]):
    from shardplan.core.roles import definition_order
    from shardplan.model.factory import ModelLoadError, build_model

    try:
        return build_model(
            factory,
            config,
            paths=tuple(args.import_paths),
            eager=getattr(args, "eager", False),
            on_built=lambda module: order.extend(definition_order(module)),
            notice=_notice,
        )
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None


def _notice(message: str) -> None:
    """One line on stderr, beside the command's output (which may be JSON on stdout)."""
    print_wrapped(consoles()[1], f"note: {message}")


def _setup_devices(requested: int | None, plan: Plan) -> None:
    from shardplan.processes.devices import DeviceSetupError, has_accelerator, simulate_cpu_devices

    if requested is None and has_accelerator():
        return
    try:
        simulate_cpu_devices(requested if requested is not None else _device_count(None, plan))
    except DeviceSetupError as exc:
        raise UsageError(str(exc)) from None


def _device_count(requested: int | None, plan: Plan) -> int:
    """--devices, else what the plan's mesh needs (8 for a -1 axis), bounded like any mesh."""
    if requested is not None:
        return requested
    fixed = math.prod(size for size in plan.mesh.axes.values() if size != -1)
    needed = fixed * max(1, 8 // fixed) if -1 in plan.mesh.axes.values() else fixed
    return min(needed, MAX_MESH_DEVICES + 1)  # one more than allowed: resolve_axes says mesh-too-large


if __name__ == "__main__":
    sys.exit(main())
