"""Calls to draw: a shipped file of one kind, mutated, and a command of the CLI that reads that kind."""

from __future__ import annotations

import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LOGICAL_RULES = """\
logical_axis_rules:
  - [activation_batch, [data, fsdp]]
  - [embed, fsdp]
  - [mlp, tensor]
  - [heads, tensor]
  - [vocab, tensor]
  - [norm, null]
"""
RULE_LIST = """\
- ["embedding_layer/token_emb/embedding", [model, null]]
- ["transformer_blocks/\\\\d+/mlp/linear1/kernel", [null, model]]
- [".*", []]
"""


def corpus() -> dict[str, list[tuple[str, str]]]:
    """(name, text) of the files each kind of call starts from."""
    plans = sorted((REPO / "plans").glob("*.yaml")) + sorted((REPO / "plans").glob("*.toml"))
    plans += [REPO / "docs/examples/seed_tutorial.yaml", REPO / "docs/examples/untrusted.yaml"]
    return {
        "plan": [(p.name, p.read_text()) for p in plans],
        "profile": [(p.name, p.read_text()) for p in sorted((REPO / "profiles").glob("*.yaml"))],
        "rules": [
            ("partition_rules.py", (REPO / "docs/examples/partition_rules.py").read_text()),
            ("rules.yaml", RULE_LIST),
        ],
        "logical": [("logical.yaml", LOGICAL_RULES)],
    }


# Pieces a careless or hostile edit puts into a file: syntax, extremes, names, regexes that backtrack,
# YAML's code tags and aliases.
WORDS = [
    "data",
    "model",
    "stage",
    "context",
    "experts",
    "fsdp",
    "-1",
    "0",
    "1",
    "3",
    "100000",
    "1e308",
    "-1e308",
    "1e-320",
    "nan",
    ".inf",
    "99999999999999999999999",
    "null",
    "~",
    "[",
    "]",
    "{",
    "}",
    ":",
    ",",
    "'",
    '"',
    "*a",
    "&a ",
    "\n",
    "\t",
    "  ",
    "- ",
    "replicated",
    "gpipe",
    "1f1b",
    "interleaved",
    "zb-h1",
    "'.*'",
    "'(a+)+$'",
    "'(?P<x>'",
    "[data, data]",
    "[null, null, null, null, null]",
    "true",
    "false",
    "!!python/name:os.system",
    "!!binary aGVsbG8=",
    "\u202e",
    "\x1b[31m",
    "\x00",
    "é",
    "🙂",
    "x" * 300,
    "version: 2",
    "axes: {}",
    "microbatches: 0",
    "virtual_stages: 3",
    "shape: [1000000000, 1000000000]",
    "num_transformer_blocks: 100000000",
    "embed_dim: 7",
    "accumulate: 1000",
    "peak_flops: 0",
    "memory: 1e300",
    "bandwidth: -5",
    "= 1",
    "[[",
    "]]",
    "import os",
    "os.system('x')",
    "def f(:",
]
NUMBERS = [
    "0",
    "-1",
    "1",
    "2",
    "3",
    "7",
    "1023",
    "65536",
    "1e300",
    "99999999999999999999",
    "0.5",
    "-0.0",
    "1e-300",
    "9" * 80,  # longer than any figure needs
    "9" * 5000,  # past Python's own limit on an integer's digits
]
# Profile figures each valid alone (or nearly) that multiply to a rate no device has.
TINY_FIGURES = {
    "link_efficiency": [1e-3, 1e-200, 0.5],
    "matmul_efficiency": [1e-3, 1e-300, 0.9],
    "attention_efficiency": [1e-3, 1e-300],
    "collective_shares": [{"all-reduce": 1e-3}, {"all-to-all": 1e-200}, {"all-gather": 1e-300}],
    "intra_host_bandwidth": [1e3, 1e4],
    "inter_host_bandwidth": [1e3, 1e4],
    "peak_flops": [1e6, 2e6],
    "devices_per_host": [True, 8.0, "8"],
}

PLANS = ["plans/minigpt_dp.yaml", "plans/minigpt_tp.yaml"]
PATHS = [
    "output_layer/kernel",
    "transformer_blocks/0/mlp/linear1/kernel",
    "transformer_blocks/99/x",
    "[",
    "",
    "a" * 500,
]


VALUES = [
    0,
    -1,
    1,
    3,
    2**63,
    1e308,
    float("nan"),
    -0.5,
    "",
    "data",
    "model",
    "stage",
    "x" * 200,
    None,
    True,
    [],
    {},
    [None],
    ["data", "data"],
    {"a": 1},
    [[1, 2]],
    "(a+)+$",
    ".*",
    "1f1b",
    "bfloat16",
    "auto",
]


def mutate_tree(text: str, rng: random.Random, suffix: str) -> str:
    """The file parsed, 1–3 of its values replaced, keys dropped or added, and written back: edits that
    pass the parser and reach the checks behind it."""
    import tomllib

    import yaml

    try:
        tree = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        return mutate(text, rng)
    for _ in range(rng.randint(1, 3)):
        holders = []

        def walk(node):
            if isinstance(node, dict):
                holders.extend((node, key) for key in node)
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                holders.extend((node, k) for k in range(len(node)))
                for value in node:
                    walk(value)

        walk(tree)
        if not holders:
            break
        node, key = rng.choice(holders)
        edit = rng.randrange(3)
        if edit == 0:
            node[key] = rng.choice(VALUES)
        elif edit == 1:
            del node[key]
        elif isinstance(node, dict):
            node[rng.choice(["extra", "axes", "spec", "match", "stage", "schedule", "memory", key + "_"])] = rng.choice(
                VALUES
            )
        else:
            node.append(rng.choice(VALUES))
    return yaml.safe_dump(tree, sort_keys=False)


def combine_figures(text: str, rng: random.Random) -> str:
    """A profile with 2-4 of its figures set to small values at once (`TINY_FIGURES`)."""
    import yaml

    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(tree, dict):
        return text
    for key in rng.sample(sorted(TINY_FIGURES), rng.randint(2, 4)):
        tree[key] = rng.choice(TINY_FIGURES[key])
    return yaml.safe_dump(tree, sort_keys=False)


def mutate(text: str, rng: random.Random) -> str:
    """1–4 edits: a word inserted or put in place of a span, a line dropped, doubled or moved, a number
    replaced by another, a character flipped, or the file cut short."""
    for _ in range(rng.randint(1, 4)):
        lines = text.splitlines(keepends=True) or [""]
        edit = rng.randrange(7)
        if edit == 0:
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(WORDS) + text[at + rng.randint(0, 12) :]
        elif edit == 1 and len(lines) > 1:
            del lines[rng.randrange(len(lines))]
            text = "".join(lines)
        elif edit == 2:
            k = rng.randrange(len(lines))
            lines.insert(k, lines[k])
            text = "".join(lines)
        elif edit == 3 and len(lines) > 1:
            line = lines.pop(rng.randrange(len(lines)))
            lines.insert(rng.randrange(len(lines) + 1), line)
            text = "".join(lines)
        elif edit == 4:
            digits = [i for i, c in enumerate(text) if c.isdigit()]
            if digits:
                at = rng.choice(digits)
                end = at
                while end < len(text) and text[end].isdigit():
                    end += 1
                text = text[:at] + rng.choice(NUMBERS) + text[end:]
        elif edit == 5 and text:
            at = rng.randrange(len(text))
            text = text[:at] + chr(rng.randrange(32, 127)) + text[at + 1 :]
        elif edit == 6:
            text = text[: rng.randint(0, len(text))]
    return text


def _options(rng: random.Random, pool: list[list[str]], most: int = 3) -> list[str]:
    return [a for option in rng.sample(pool, rng.randint(0, min(most, len(pool)))) for a in option]


MODEL = [
    "--model",
    "minigpt_model:MiniGPT",
    "--config",
    "num_transformer_blocks=2",
    "--config",
    "embed_dim=32",
    "--config",
    "num_heads=2",
    "--config",
    "feed_forward_dim=64",
    "--config",
    "maxlen=16",
    "--config",
    "vocab_size=256",
]
INSPECT = [
    ["--devices", "8"],
    ["--devices", "3"],
    ["--seq", "16"],
    ["--seq", "1048577"],
    ["--batch", "8"],
    ["--batch", "0"],
    ["--device", "2"],
    ["--device", "99"],
    ["--json"],
    ["--all-params"],
    ["--profile", "h100-80gb-sxm"],
    ["--profile", "nope"],
]


def draw_call(rng: random.Random, number: int, files: dict[str, list[tuple[str, str]]]) -> dict:
    """One call: {id, devices, kind, source, files: {name: text}, argv} (file names relative to the call's folder)."""
    kind = rng.choices(["plan", "profile", "rules", "logical"], weights=[6, 2, 1, 1])[0]
    source, text = rng.choice(files[kind])
    suffix = Path(source).suffix
    structured = suffix in (".yaml", ".toml") and rng.random() < 0.5
    suffix = ".yaml" if structured else suffix
    name = f"mutated{suffix}"
    mutated = mutate_tree(text, rng, Path(source).suffix) if structured else mutate(text, rng)
    if kind == "profile" and rng.random() < 0.3:
        name, mutated = "combined.yaml", combine_figures(text, rng)
    if kind == "plan":
        command = rng.choice(["validate", "inspect", "explain", "diff", "params", "export"])
        argv = {
            "validate": lambda: [
                "validate",
                name,
                *_options(rng, [["--strict"], ["--plan-only"], ["--devices", "8"], MODEL]),
            ],
            "inspect": lambda: ["inspect", name, *_options(rng, INSPECT)],
            "explain": lambda: ["explain", name, rng.choice(PATHS)],
            "diff": lambda: [
                "diff",
                name,
                str(REPO / rng.choice(PLANS)),
                *_options(rng, [["--json"], ["--all-params"]]),
            ],
            "params": lambda: ["params", *MODEL, "--plan", name, *_options(rng, [["--json"], ["--all-params"]])],
            "export": lambda: ["export", name, *rng.choice([[], ["--format", "yaml"]])],
        }[command]()
    elif kind == "profile":
        command = rng.choice(["profiles", "inspect", "auto"])
        argv = {
            "profiles": lambda: ["profiles", name, *rng.choice([[], ["--json"]])],
            "inspect": lambda: ["inspect", str(REPO / rng.choice(PLANS)), "--profile", name],
            "auto": lambda: [
                "auto",
                *MODEL,
                "--devices",
                "4",
                "--batch",
                "8",
                "--seq",
                "16",
                "--profile",
                name,
                "--top",
                "2",
                "-o",
                "proposed.yaml",
            ],
        }[command]()
    elif kind == "rules":
        command = "convert"
        argv = [
            "convert",
            name,
            "--mesh",
            rng.choice(["dp=4,mp=2", "data=8", "dp=0", "dp=4,dp=2"]),
            *_options(
                rng,
                [["--input-spec", "dp"], ["--list", "LlamaConfig"], ["--flag", "fully_sharded_data_parallel=false"]],
            ),
            "-o",
            "converted.yaml",
        ]
    else:
        command = "convert"
        argv = [
            "convert",
            "--logical-rules",
            name,
            "--mesh",
            rng.choice(["data=4,tensor=2", "fsdp=8", "x=8"]),
            "-o",
            "converted.yaml",
        ]
    return {
        "id": number,
        "devices": 8,
        "kind": kind,
        "source": source,
        "command": command,
        "files": {name: mutated},
        "argv": argv,
    }


def calls(seed: int, count: int) -> list[dict]:
    rng, files = random.Random(seed), corpus()
    return [draw_call(rng, k, files) for k in range(count)]
