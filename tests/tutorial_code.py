"""Classes and functions of the public tutorials kept in tests/tutorials/ (unmodified), taken by name
from their code cells exactly as written and run in a namespace of the imports the notebooks make.
Only definitions are taken: the cells' other statements download data or build full-size models.

- `vit()`: the jax-ai-stack ViT tutorial's `VisionTransformer` (blocks in an `nnx.Sequential`, default
  `rngs=nnx.Rngs(0)` arguments), its loss and its `train_step` (`nnx.ModelAndOptimizer`'s `update(grads)`).
- `translation()`: the jax-ai-stack encoder-decoder translation `TransformerModel` and its `train_step`.
- `segmentation()`: the jax-ai-stack UNETR tutorial's blocks (submodules built with a default `nnx.Rngs(0)`).
- `unetr()`: that tutorial's whole `UNETR`, whose decoder reads four of its ViT's block outputs. Its ViT
  and up-sampling blocks keep their blocks in plain Python lists, which flax 0.12 refuses on a pytree
  module; the classes are taken as written and declared `pytree=False` by subclassing, flax's own advice.
- `cell(notebook, line)`: the whole code cell holding `line`, to run as published (flax's checkpointing
  guide's save cell writes a checkpoint of any model given as `model`; flax's optimization cookbook's
  LoRA cells wrap its toy model and train the adapters).
- `gspmd()`: the flax guide "Scale up on multiple devices": `DotReluDot` (annotated with
  `nnx.with_partitioning`, built under flax's eager sharding), the explicit-axes `ExplicitDotReluDot`, and
  the guide's `jax.jit` `train_step`.
"""

from __future__ import annotations

import ast
import re
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

HERE = Path(__file__).parent / "tutorials"
IMPORTS = dict(
    jax=jax,
    jnp=jnp,
    np=np,
    nnx=nnx,
    optax=optax,
    partial=partial,
    P=P,
    NamedSharding=NamedSharding,
    AxisType=AxisType,
    Callable=Callable,
)


def _cells(notebook: str) -> list[str]:
    """The notebook's code cells: MyST `{code-cell}` blocks, or the `python` blocks of jupytext markdown."""
    out = []
    found = re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```|```python\n(.*?)```", (HERE / notebook).read_text(), re.S)
    for text in (myst or plain for myst, plain in found):
        out.append(text.split("\n---\n", 1)[1] if text.startswith("---\n") else text)  # (a cell's metadata)
    return out


def cell(notebook: str, line: str) -> str:
    """The code cell of `notebook` that holds `line`, as published."""
    found = [c for c in _cells(notebook) if line in c.splitlines()]
    assert len(found) == 1, f"{notebook} has {len(found)} code cells holding {line!r}"
    return found[0]


def definitions(notebook: str, names: list[str]) -> dict:
    """A namespace holding `names`, defined by the notebook's own source text, in the order given."""
    found = {}
    for source in _cells(notebook):
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a cell of notebook magics (%%timeit)
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                found[node.name] = "\n".join(lines[start - 1 : node.end_lineno])
    missing = set(names) - set(found)
    assert not missing, f"{notebook} no longer defines {sorted(missing)}"
    namespace = dict(IMPORTS)
    for name in names:
        exec(compile(found[name], f"{HERE / notebook}:{name}", "exec"), namespace)
    return namespace


def vit() -> dict:
    return definitions(
        "JAX_Vision_transformer.md",
        ["TransformerEncoder", "VisionTransformer", "compute_losses_and_logits", "train_step"],
    )


def translation() -> dict:
    return definitions(
        "JAX_machine_translation.md",
        [
            "TransformerEncoder",
            "PositionalEmbedding",
            "TransformerDecoder",
            "TransformerModel",
            "compute_loss",
            "train_step",
        ],
    )


def segmentation() -> dict:
    return definitions(
        "JAX_examples_image_segmentation.md",
        ["Conv2dNormActivation", "InstanceNorm", "UnetResBlock", "UnetrBasicBlock"],
    )


def unetr() -> dict:
    from flax import nnx

    ns = definitions(
        "JAX_examples_image_segmentation.md",
        [
            "PatchEmbeddingBlock",
            "MLPBlock",
            "ViTEncoderBlock",
            "ViT",
            "Conv2dNormActivation",
            "InstanceNorm",
            "UnetResBlock",
            "UnetrBasicBlock",
            "UnetrPrUpBlock",
            "UnetrUpBlock",
            "UNETR",
        ],
    )
    for name in ("ViT", "UnetrPrUpBlock", "UNETR"):  # (the classes' code finds these by name in `ns`)
        ns[name] = type(name, (ns[name],), {}, pytree=False)
    assert issubclass(ns["ViT"], nnx.Module)
    return ns


def gspmd() -> dict:
    return definitions("flax_gspmd.md", ["DotReluDot", "MultiDotReluDot", "ExplicitDotReluDot", "train_step"])


UnetrBasicBlock = segmentation()["UnetrBasicBlock"]  # for `--model tutorial_code:UnetrBasicBlock`
