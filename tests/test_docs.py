"""The examples in public docstrings run (on the 8 simulated devices) and print what they say."""

import doctest
import importlib
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

MODULES = [
    "shardplan.plan.schema",
    "shardplan.core.layout",
    "shardplan.core.mesh",
    "shardplan.run.hlo",
    "shardplan.core.paths",
    "shardplan.plan.loader",
    "shardplan.compose.check",
    "shardplan.compose.apply",
    "shardplan.compose.restore",
    "shardplan.run.specs",
    "shardplan.core.roles",
    "shardplan.planner.auto",
    "shardplan.plan.matching",
    "shardplan.planner.profiles",
    "shardplan.plan.inert",
    "shardplan.plan.writer",
    "shardplan.model.factory",
    "shardplan.pipeline.loop",
    "shardplan.review.diff",
    "shardplan.planner.overlap",
    "shardplan.pipeline.pipelined",
    "shardplan.processes.flags",
    "shardplan.pipeline.stacked",
    "shardplan.pipeline.constraints",
    "shardplan.training",
    "shardplan.terminal",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def api_reference() -> str:
    """docs/api.md: every public name of `shardplan`, its signature and its docstring, whose examples
    `test_docstring_examples` runs (a `>>>` example becomes a `pycon` block)."""
    import inspect

    import shardplan

    lines = [
        "# API reference",
        "",
        "Every name `import shardplan` exports, with its signature and docstring. Generated from the code "
        "(`SHARDPLAN_UPDATE_GOLDEN=1 python -m pytest tests/test_docs.py -k api`; a test keeps it equal), and "
        "every `>>>` example below runs in the test suite on 8 simulated CPU devices. The plan file itself is "
        "described in [plan-format.md](plan-format.md), the step options in [step.md](step.md), a worked "
        "example with your own model and loop in [your-model.md](your-model.md). These names are the "
        "interface; the modules under `shardplan/` that they come from are internal and may change.",
        "",
    ]
    for name in shardplan.__all__:
        obj = getattr(shardplan, name)
        if isinstance(obj, dict):
            lines += [
                f"## `shardplan.{name}`",
                "",
                f"A dict of the {len(obj)} diagnostic codes, each to its one-line "
                "meaning (the table in [diagnostics.md](diagnostics.md) says more).",
                "",
            ]
            continue
        if inspect.ismodule(obj):  # a namespace: its own names, one level down
            lines += [f"## `shardplan.{name}`", "", *_documented(obj)]
            for member in obj.__all__:
                lines += _entry(f"shardplan.{name}.{member}", getattr(obj, member), "###")
            continue
        lines += _entry(f"shardplan.{name}", obj, "##")
    return "\n".join(lines).rstrip() + "\n"


def _entry(qualified: str, obj, heading: str) -> list[str]:
    """One name's heading (its signature; a constant's value) and docstring, a class's members after."""
    import inspect

    if not (inspect.isclass(obj) or callable(obj)):
        return [f"{heading} `{qualified} = {obj!r}`", ""]
    kind = "class " if inspect.isclass(obj) else ""
    signature = "" if inspect.isclass(obj) else str(inspect.signature(obj)).replace("'", "")
    lines = [f"{heading} {kind}`{qualified}{signature}`", "", *_documented(obj)]
    return lines + (_members(obj) if inspect.isclass(obj) else [])


def _documented(obj) -> list[str]:
    """The docstring as Markdown: a `>>>` example becomes a `pycon` block."""
    import inspect

    prose, example = [], []
    for line in (inspect.getdoc(obj) or "").splitlines() + [""]:
        if line.startswith((">>>", "...")) or (example and line):
            example.append(line)
            continue
        if example:
            prose += ["```pycon", *example, "```"]
            example = []
        prose.append(line)
    return [*prose[:-1], ""]


def _members(cls) -> list[str]:
    """A class's fields (dataclass or plan sections) and its public methods and properties, one line each."""
    import dataclasses
    import inspect

    fields = (
        list(cls.model_fields)
        if hasattr(cls, "model_fields")
        else [f.name for f in dataclasses.fields(cls)]
        if dataclasses.is_dataclass(cls)
        else []
    )
    rows = [f"- `{name}`" for name in fields if not name.startswith("_")]
    for name, member in vars(cls).items():
        if (
            name.startswith(("_", "model_"))
            or name in fields
            or not (inspect.isfunction(member) or isinstance(member, property))
        ):
            continue
        doc = (inspect.getdoc(member) or "").split("\n\n")[0].replace("\n", " ")
        call = (
            ""
            if isinstance(member, property)
            else str(inspect.signature(member)).replace("(self, ", "(").replace("(self)", "()").replace("'", "")
        )
        rows.append(f"- `{name}{call}`" + (f": {doc}" if doc else ""))
    return ([("Fields and members:" if fields else "Members:"), "", *rows, ""]) if rows else []


def test_the_api_reference_is_the_docstrings():
    page = REPO / "docs" / "api.md"
    if os.environ.get("SHARDPLAN_UPDATE_GOLDEN"):
        page.write_text(api_reference())
    assert page.read_text() == api_reference()


def _blocks(path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.S | re.M)


def test_the_readme_python_example_runs_as_written_in_a_fresh_process(tmp_path):
    (example,) = _blocks(REPO / "README.md", "python")
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ok, loss = done.stdout.splitlines()[:2]
    assert ok.startswith("True") and float(loss) > 0, done.stdout


def test_the_your_model_example_trains_every_plan_like_one_device_in_a_fresh_process():
    """docs/your-model.md's file, run as the page says: its own assertions compare each plan with one device."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, "docs/examples/your_model.py"],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "every plan trains like one device", done.stdout
    page = (REPO / "docs" / "your-model.md").read_text()
    for line in done.stdout.splitlines():  # the page shows what the file prints (its losses to 1e-5)
        name, *losses = line.rsplit(maxsplit=3) if line[:1] != "e" else (line,)
        shown = next(line for line in page.splitlines() if line.startswith(name))
        np.testing.assert_allclose(
            [float(x) for x in losses], [float(x) for x in shown.split()[-len(losses) :]] if losses else [], rtol=1e-5
        )


def _commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for block in _blocks(path, "console"):
            found += [
                (path.name, line[2:].split("  #")[0].strip())
                for line in block.splitlines()
                if line.startswith("$ shardplan ")
            ]
    return found


@pytest.mark.parametrize("page, command", _commands())
def test_every_shardplan_command_the_docs_show_runs(page, command, tmp_path, capsys):
    """Exit 0 (or 1 where the page shows the plan refused); never 2, a file or option the page invents."""
    from shardplan.cli import main

    argv = shlex.split(command.split(" > ")[0])[1:]
    for flag in ("-o", "--svg"):
        if flag in argv:
            argv[argv.index(flag) + 1] = str(tmp_path / argv[argv.index(flag) + 1])
    code = main(argv)
    out = capsys.readouterr()
    assert code in (0, 1), (page, command, out.out[-2000:] + out.err[-2000:])


def test_every_yaml_example_in_the_docs_reads_and_every_whole_plan_validates():
    import yaml

    import shardplan
    from shardplan.review.report import check_plan_only

    examples = [(path.name, block) for path in DOCS for block in _blocks(path, "yaml")]
    assert len(examples) >= 5
    for page, block in examples:
        assert isinstance(yaml.safe_load(block), dict), (page, block[:200])
        if block.lstrip().startswith(("version: 1", "# ")) and "version: 1" in block:
            plan = shardplan.parse_plan(block, file=page)
            errors = [d for d in check_plan_only(plan, 8) if d.severity == "error"]
            assert not errors, (page, [d.format() for d in errors])


def test_the_shipped_plans_and_the_docs_whole_plans_validate_with_their_model_in_a_fresh_process(tmp_path):
    """As a user runs `shardplan validate FILE` on a new machine: one JAX device, nothing simulated (a check
    that needed the plan's devices refused plans/minigpt_moe_ep.yaml there, while the suite's 8 devices hid it)."""
    files = sorted(str(p) for p in (REPO / "plans").iterdir() if p.suffix in (".yaml", ".toml"))
    for page in ("experts.md", "context.md", "pipelines.md"):
        block = re.search(r"```yaml\n(.*?)```", (REPO / "docs" / page).read_text(), re.S).group(1)
        (tmp_path / f"{page}.yaml").write_text(block)
        files.append(str(tmp_path / f"{page}.yaml"))
    script = (
        "import sys; from shardplan.cli import main\n"
        "sys.exit(max(main(['validate', '--strict', f]) for f in sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *files],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("valid: 0 warning(s)") == len(files), result.stdout[-3000:]


def test_the_example_trainer_uses_the_public_names_alone():
    """`minigpt_model`, the trainer users copy, imports from `shardplan`, `shardplan.training` and
    `shardplan.terminal` only, and only names they export."""
    import ast

    import shardplan

    public = {"shardplan": set(shardplan.__all__)}
    for space in ("training", "terminal"):
        public[f"shardplan.{space}"] = set(getattr(shardplan, space).__all__)
    used = []
    for file in sorted((REPO / "minigpt_model").glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardplan"):
                used += [(file.name, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                used += [(file.name, a.name, None) for a in node.names if a.name.startswith("shardplan.")]
    assert used, "the trainer imports nothing of shardplan?"
    outside = [u for u in used if u[1] not in public or (u[2] is not None and u[2] not in public[u[1]])]
    assert outside == []


def test_the_readmes_inspect_sample_is_what_inspect_prints(capsys, monkeypatch):
    """The README's `inspect` block, cut at its `...` lines, is the command's own output at 80 columns: each
    part the lines it prints, in its order."""
    from shardplan.cli import main

    readme = (REPO / "README.md").read_text()
    command = "$ shardplan inspect plans/minigpt_dp_tp.yaml\n"
    block = readme[readme.index(command) + len(command) :].split("```", 1)[0]
    parts = [part.strip("\n").split("\n") for part in block.split("...\n") if part.strip()]
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["inspect", "plans/minigpt_dp_tp.yaml"]) == 0
    printed, at = capsys.readouterr().out.split("\n"), 0
    assert len(parts) >= 3 and sum(map(len, parts)) >= 12
    for part in parts:
        starts = [k for k in range(at, len(printed)) if printed[k : k + len(part)] == part]
        assert starts, "the README shows lines inspect does not print in this order:\n" + "\n".join(part)
        at = starts[0] + len(part)
