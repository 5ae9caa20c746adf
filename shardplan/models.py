"""Building the model a plan names (`module:callable`), abstractly, for the command line."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

import yaml
from flax import nnx


class ModelLoadError(Exception):
    """The named model cannot be imported or built."""


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["embed_dim=512", "name=x"]` -> `{"embed_dim": 512, "name": "x"}` (values read as YAML scalars)."""
    config = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ModelLoadError(f"--config requires key=value, but got {pair!r}")
        config[key.strip()] = yaml.safe_load(value)
    return config


def resolve_factory(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise ModelLoadError(f"a model factory is written module:callable, but got {spec!r}")
    if os.getcwd() not in sys.path:     # like `python -m`: the user's own modules import from here
        sys.path.append(os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(f"cannot import module {module_name!r} of model {spec!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ModelLoadError(f"module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def _accepts_rngs(factory) -> bool:
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        return "rngs" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def build_model(spec: str, config: dict[str, Any], *, abstract: bool = True, seed: int = 0, on_built=None):
    """Call the factory with `config` (and `rngs=` if it takes one); abstract via `nnx.eval_shape`.

    `on_built(module)` sees the freshly built module, before `eval_shape` rebuilds it abstractly
    (which sorts its attributes: read definition order there).
    """
    factory = resolve_factory(spec)
    wants_rngs = _accepts_rngs(factory)

    def construct():
        # Rngs are made inside the construction so that eval_shape traces them too.
        module = factory(**config, **({"rngs": nnx.Rngs(seed)} if wants_rngs else {}))
        if on_built is not None:
            on_built(module)
        return module

    try:
        return nnx.eval_shape(construct) if abstract else construct()
    except TypeError as exc:
        raise ModelLoadError(f"cannot build model {spec!r} with config {config}: {exc}") from None
