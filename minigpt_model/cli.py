"""`minigpt`: train MiniGPT under a shardplan plan, and sample from its checkpoints."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from shardplan.terminal import ArgumentParser, HelpFormatter

DESCRIPTION = """\
Train the article's MiniGPT, sharded by a shardplan plan, and sample from it.

`minigpt train` alone trains on the built-in story corpus with plans/minigpt_dp_tp.yaml on
8 simulated CPU devices (no download, a few minutes on two cores), checkpoints to runs/minigpt,
and prints a sample at the end.
"""

EPILOG = """\
examples:
  minigpt train
  minigpt train --plan plans/minigpt_fsdp.toml --steps 2000 --out runs/fsdp
  minigpt train --out runs/fsdp --resume            # continue a run exactly where it stopped
  minigpt train --data stories.txt --config embed_dim=256 --config num_transformer_blocks=8
  minigpt sample --checkpoint runs/minigpt --prompt "Once upon a time" --temperature 0.8 --top-k 20
  minigpt launch --local 2 -- train --out runs/two          # 2 processes x 4 simulated devices
  minigpt launch --ray --address HEAD:6379 --num-workers 4 -- train --out /shared/run

exit status: 0 done, 1 bad plan, data, checkpoint or run directory (also: another run there,
a full disk), 2 usage error (bad option or --config), 3 a bug in minigpt/shardplan, 75 preempted
(SIGTERM: the step in flight was saved, or the last checkpoint kept; run again with --resume),
130 interrupted
"""


def _number(kind, minimum, maximum=None):
    """argparse type: a finite `kind` (int or float) in [minimum, maximum]."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"requires {'an integer' if kind is int else 'a number'}, but got {text!r}"
            ) from None
        if (
            value != value
            or value in (float("inf"), float("-inf"))
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"requires a value {bound}, but got {text}")
        return value

    return parse


POSITIVE, NON_NEGATIVE = _number(int, 1), _number(int, 0)
SEED = _number(int, 0, 2**32 - 1)  # what jax.random.key and NumPy's generators take


def _separator(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("requires a non-empty text (documents are split on it)")
    return text


class _Defaults(HelpFormatter):
    """Shows each option's default, unless it has none worth showing or its help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text
            or action.default is None
            or action.default is False
            or action.default == []
            or action.default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from minigpt_model.trainer import TrainConfig

    defaults = TrainConfig()
    parser = ArgumentParser(prog="minigpt", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train under a plan (defaults: built-in corpus, dp x tp on 8 devices)",
        description="Train MiniGPT under a shardplan plan; checkpoints, metrics.jsonl and "
        "loss.png (with the plot extra) go to --out.",
        formatter_class=_Defaults,
    )
    train.add_argument("--plan", default=defaults.plan, help="plan file")
    train.add_argument("--steps", type=POSITIVE, default=defaults.steps, help="total optimizer steps")
    train.add_argument("--batch-size", type=POSITIVE, default=defaults.batch_size, help="global batch, in sequences")
    train.add_argument(
        "--lr", type=_number(float, 0.0), default=defaults.lr, help="peak learning rate (warmup, then cosine)"
    )
    train.add_argument(
        "--warmup-steps", type=NON_NEGATIVE, default=defaults.warmup_steps, help="steps of linear learning-rate warmup"
    )
    train.add_argument(
        "--eval-every", type=POSITIVE, default=defaults.eval_every, help="evaluate on held-out batches every N steps"
    )
    train.add_argument(
        "--checkpoint-every",
        type=POSITIVE,
        default=defaults.checkpoint_every,
        help="save a checkpoint every N steps (and at the end)",
    )
    train.add_argument(
        "--seed", type=SEED, default=defaults.seed, help="seed of the initial weights, the data order and dropout"
    )
    train.add_argument(
        "--data",
        nargs="+",
        default=[],
        metavar="FILE",
        help="text files, split into documents on --separator (default: built-in stories)",
    )
    train.add_argument(
        "--separator", type=_separator, default=defaults.separator, help="text that separates documents in --data files"
    )
    train.add_argument(
        "--tokenizer",
        choices=["bytes", "gpt2"],
        default=defaults.tokenizer,
        help="bytes (built in) or gpt2 (tiktoken, files must be local)",
    )
    train.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model setting, e.g. embed_dim=256, num_transformer_blocks=8, maxlen=256",
    )
    train.add_argument("--out", default=defaults.out, help="run directory: checkpoints, metrics.jsonl, loss.png")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    train.add_argument(
        "--devices",
        type=_number(int, 1, 4096),
        metavar="N",
        help="simulate N CPU devices in this process (default without an accelerator: 8)",
    )
    train.add_argument(
        "--preemption-grace",
        type=_number(float, 0.0, 86400.0),
        default=defaults.preemption_grace,
        metavar="S",
        help="on SIGTERM, finish the step, save and exit 75; give up after S seconds, keeping the last checkpoint",
    )
    train.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="join a multi-process run whose process 0 listens at HOST:PORT (also read from "
        "JAX_COORDINATOR_ADDRESS; under SLURM or Open MPI all three are detected)",
    )
    train.add_argument("--num-processes", type=POSITIVE, metavar="N", help="processes in the run")
    train.add_argument("--process-id", type=NON_NEGATIVE, metavar="I", help="this process's index, 0..N-1")
    train.add_argument("--debug", action="store_true", help="show Python tracebacks")
    train.set_defaults(handler=_train)

    launch = commands.add_parser(
        "launch",
        help="run `train` as several processes (one per host)",
        description="Start one `minigpt train` process per worker and stream their output.",
    )
    where = launch.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", type=POSITIVE, metavar="N", help="N processes on this machine")
    where.add_argument("--ray", action="store_true", help="one Ray actor per worker (pip install -e '.[ray]')")
    launch.add_argument("--address", help="Ray cluster address (default: start or join a local one)")
    launch.add_argument("--num-workers", type=POSITIVE, metavar="N", help="Ray workers")
    launch.add_argument(
        "--devices-per-process",
        type=_number(int, 1, 4096),
        metavar="K",
        help="simulate K CPU devices in each process (default without an accelerator: 8 / N)",
    )
    launch.add_argument(
        "--verbose", action="store_true", help="also show third-party connection logs (gloo's per-rank lines)"
    )
    launch.add_argument("command", nargs=argparse.REMAINDER, help="-- train [train options]")
    launch.set_defaults(handler=_launch, debug=False)

    sample = commands.add_parser(
        "sample", help="generate text from a run's latest checkpoint", formatter_class=_Defaults
    )
    sample.add_argument("--checkpoint", required=True, metavar="DIR", help="run directory (the --out of train)")
    sample.add_argument("--prompt", default="Once upon a time", help="text to continue")
    sample.add_argument("--max-tokens", type=POSITIVE, default=200, help="tokens to generate")
    sample.add_argument("--temperature", type=_number(float, 0.0), default=0.8, help="0 picks the most likely token")
    sample.add_argument(
        "--top-k",
        type=NON_NEGATIVE,
        default=20,
        help="sample among the k most likely tokens (0: all; at most the vocabulary size)",
    )
    sample.add_argument("--seed", type=SEED, default=0, help="seed of the sampling")
    sample.add_argument("--debug", action="store_true", help="show Python tracebacks")
    sample.set_defaults(handler=_sample)
    return parser


def _sharding_type_error() -> type:
    from jax._src import core

    return getattr(core, "ShardingTypeError", ())  # () catches nothing if JAX moves it


def main(argv: list[str] | None = None) -> int:
    import warnings

    from shardplan.terminal import inert_streams
    from shardplan import PlanWarning
    from shardplan.training import interrupt_once

    # input text never drives the terminal, whatever prints it; a second Ctrl-C never interrupts the first
    with interrupt_once(), inert_streams(), warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)  # (its summary shows the plan's warnings; its steps use
        return _main(argv)  # model_loss, its evaluation the plain forward)


def _main(argv: list[str] | None) -> int:
    from shardplan.terminal import consoles, print_wrapped

    args = build_parser().parse_args(argv)
    # markup=False: file names, prompts and messages are printed as they are.
    console, err = consoles()
    from minigpt_model.checkpoint import CheckpointError
    from minigpt_model.data import DataError
    from minigpt_model.tokenizer import TokenizerUnavailable
    from minigpt_model.trainer import ModelConfigError, RunError
    from shardplan import PlanError
    from shardplan.terminal import print_error, report_bug
    from shardplan.training import DeviceSetupError
    from shardplan.training import lost_a_peer
    from shardplan.training import ModelLoadError
    from shardplan.training import EXIT_PREEMPTED, Preempted

    try:
        return args.handler(args, console)
    except Preempted as exc:
        if not getattr(args, "process_id", None):
            print_wrapped(err, str(exc))
        return EXIT_PREEMPTED
    except PlanError as exc:
        from shardplan.terminal import render_diagnostics

        render_diagnostics(err, exc.diagnostics)
        return 1
    except (RunError, DataError, CheckpointError, TokenizerUnavailable) as exc:
        print_error(err, str(exc))
        if getattr(args, "debug", False) and getattr(exc, "detail", None):
            err.print(exc.detail, soft_wrap=True)
        return 1
    except _sharding_type_error() as exc:
        # a plan problem: explicit mesh axes, and an op whose output sharding JAX cannot infer
        print_error(
            err,
            f"the plan's explicit mesh axes leave an output sharding undecided: "
            f"{str(exc).splitlines()[0]}; give the module that computes it an `activations` rule "
            "(for MiniGPT: embedding_layer/token_emb -> [data], embedding_layer/pos_emb -> []), or make "
            "the axis auto in mesh.types",
        )
        return 1
    except (ModelLoadError, ModelConfigError, DeviceSetupError, UsageError) as exc:
        print_error(err, str(exc))
        return 2
    except KeyboardInterrupt:
        err.print("interrupted; the last checkpoint is intact (continue with --resume)")
        return 130
    except Exception as exc:
        if getattr(args, "num_processes", None) and lost_a_peer(exc):
            print_error(
                err,
                f"another process of this run stopped ({_first_line(exc)}); this process stops too. "
                "The launcher names the one that failed; continue the run with --resume",
            )
            return 1
        if isinstance(exc, OSError) and exc.filename:  # the environment: a file, a disk, a permission
            print_error(err, f"cannot use {exc.filename}: {(exc.strerror or str(exc)).lower()}")
            return 1
        if _out_of_memory(exc):
            print_error(
                err,
                f"out of memory: {_first_line(exc)}; use a smaller --config or --batch-size, or a plan "
                "that splits more (shardplan inspect PLAN shows the memory a device needs)",
            )
            return 1
        return report_bug(err, exc, debug=args.debug, program="minigpt")  # a bug of ours


def _out_of_memory(exc: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(exc) or isinstance(exc, MemoryError)


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


class UsageError(Exception):
    """An option that cannot work with what it is applied to (exit 2)."""


def _devices(requested: int | None, plan_path: str | None = None) -> None:
    from shardplan.training import has_accelerator
    from shardplan import simulate_cpu_devices
    from shardplan import set_performance_flags

    if requested is not None or not has_accelerator():
        simulate_cpu_devices(8 if requested is None else requested)
    else:
        # on a GPU: the XLA flags the cost model's time assumes, the plan's collective matmul too
        set_performance_flags(_plan_or_none(plan_path))


def _plan_or_none(path: str | None):
    """The plan at `path` read before JAX starts (its mistakes are reported when it is used)."""
    from shardplan import PlanError
    from shardplan import load_plan

    try:
        return load_plan(path) if path else None
    except PlanError:
        return None


def _train(args, console: Console) -> int:
    _devices(args.devices, args.plan)
    from shardplan.training import initialize

    if args.process_id is not None:
        from minigpt_model.launch import follow_launcher

        follow_launcher()
    initialize(coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    from shardplan.training import parse_overrides
    from minigpt_model.trainer import TrainConfig, train

    config = TrainConfig(
        plan=args.plan,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        data=tuple(args.data),
        separator=args.separator,
        tokenizer=args.tokenizer,
        out=args.out,
        resume=args.resume,
        model=parse_overrides(args.config),
        preemption_grace=args.preemption_grace,
    )
    result = train(config, console=console)
    last = max(result.losses) if result.losses else config.steps
    if not args.process_id:
        console.print(f"done: step {last}, run in {result.out}")
    return 0


def _launch(args, console: Console) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    workers = args.local if args.local else args.num_workers
    from shardplan.training import DeviceSetupError, has_accelerator

    if not workers or workers < 1:
        raise DeviceSetupError("launch requires a positive --local N or --num-workers N")
    per_process = args.devices_per_process or (None if has_accelerator() else max(1, 8 // workers))
    if args.ray:
        from minigpt_model.ray_launch import launch_ray

        return launch_ray(workers, command, devices_per_process=per_process, address=args.address, verbose=args.verbose)
    from minigpt_model.launch import launch_local

    return launch_local(workers, command, devices_per_process=per_process, verbose=args.verbose)


def _sample(args, console: Console) -> int:
    from minigpt_model.checkpoint import restore_for_inference
    from minigpt_model.sampling import generate
    from rich.text import Text
    from shardplan.terminal import consoles

    err = consoles()[1]
    model, tokenizer, model_config = restore_for_inference(
        args.checkpoint, warn=lambda message: err.print(Text.assemble(("warning: ", "yellow"), message))
    )
    if args.top_k > tokenizer.vocab_size:
        raise UsageError(
            f"--top-k {args.top_k} is larger than the vocabulary ({tokenizer.vocab_size} tokens); "
            f"use at most {tokenizer.vocab_size}, or 0 for all"
        )
    ids = generate(
        model,
        tokenizer.encode(args.prompt),
        maxlen=model_config["maxlen"],
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    from minigpt_model.tokenizer import END_OF_TEXT

    console.print(args.prompt + tokenizer.decode(ids).split(END_OF_TEXT)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
