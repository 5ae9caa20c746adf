"""Building the model a plan names (`module:callable`), abstractly, for the command line.

A plan is data. Its `model.factory` names code, so the command line imports and calls it only
with the user's consent (see `consented`); `--model` is consent for what the user typed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
import typing
from typing import Any

import yaml
from flax import nnx

from shardplan.model.abstract import eval_shape, first_line, untraceable


class ModelLoadError(Exception):
    """The named model cannot be imported or built."""


class NotAModule(TypeError):
    """A factory returned something other than an NNX module."""


# Factories shipped with shardplan: a plan may name them without consent (they only build a model).
BUILTIN_FACTORIES = frozenset({"minigpt_model:MiniGPT", "minigpt_model.model:MiniGPT", "minigpt_model.llama:Llama"})
TRUST_ENV = "SHARDPLAN_TRUST_PLAN"


def consented(factory: str, *, typed: bool, trust_flag: bool) -> bool:
    """May `factory` be imported and called? Yes if the user typed it (`--model`), passed `--trust-plan`
    or set SHARDPLAN_TRUST_PLAN=1, or it is one of shardplan's own models.

    >>> consented("os:system", typed=False, trust_flag=False)
    False
    >>> consented("minigpt_model:MiniGPT", typed=False, trust_flag=False)
    True
    """
    return typed or trust_flag or os.environ.get(TRUST_ENV, "") in ("1", "true", "yes") or factory in BUILTIN_FACTORIES


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["embed_dim=512", "name=x"]` -> `{"embed_dim": 512, "name": "x"}` (values read as YAML scalars)."""
    config = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ModelLoadError(f"--config requires key=value, but got {pair!r}")
        try:
            config[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ModelLoadError(
                f"--config {key.strip()}: {value!r} is not a YAML value ({getattr(exc, 'problem', None) or exc})"
            ) from None
    return config


def resolve_factory(spec: str, paths: list[str] | tuple[str, ...] = ()):
    """The callable `module:attr` names. The folders in `paths` (`--path`) and then the working directory
    are searched too (like `python -m`), only for this import and only after the installed packages, so
    they cannot shadow them."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ModelLoadError(f"a model factory is written module:callable, but got {spec!r}")
    folders = [os.path.abspath(p) for p in paths] + [os.getcwd()]
    added = [folder for folder in dict.fromkeys(folders) if folder not in sys.path]
    sys.path.extend(added)
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"cannot import module {module_name!r} of model {spec!r}: {exc} (searched the "
            f"installed packages and {', '.join(dict.fromkeys(folders))}; add the folder that "
            "holds it with --path DIR, run from it, or install it)"
        ) from None
    except Exception as exc:
        raise ModelLoadError(
            f"importing module {module_name!r} of model {spec!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        for folder in added:
            if folder in sys.path:
                sys.path.remove(folder)
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ModelLoadError(f"module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ModelLoadError(f"model factory {spec!r} is a {type(target).__name__}, not a class or function")
    return target


def _accepts_rngs(factory) -> bool:
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        return "rngs" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def config_arguments(factory, config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `factory` from flat `config` keys.

    Keys the factory takes are passed as they are. The rest fill a config object, the convention of
    models built as `Model(config, *, rngs)`: the factory's parameter annotated with a dataclass or a
    pydantic model is built from those keys (its other fields keep their defaults; with no keys, from
    its defaults alone when the factory requires it).

    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Config:
    ...     width: int = 8
    ...     depth: int = 2
    >>> def build(config: Config, seed: int = 0): ...
    >>> config_arguments(build, {"depth": 4, "seed": 1})
    {'seed': 1, 'config': Config(width=8, depth=4)}
    """
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        parameters = inspect.signature(target).parameters
        hints = typing.get_type_hints(target)
    except (TypeError, ValueError, NameError):
        return dict(config)
    direct = {k: v for k, v in config.items() if k in parameters}
    rest = {k: v for k, v in config.items() if k not in parameters}
    holders = [(name, hints[name]) for name in parameters if name in hints and _is_config_class(hints[name])]
    if not holders or any(name in direct for name, _ in holders):
        return dict(config)
    name, config_class = holders[0]
    if not rest and parameters[name].default is not inspect.Parameter.empty:
        return dict(config)  # nothing to set, and the factory has its own default config
    try:
        return {**direct, name: config_class(**rest)}
    except Exception as exc:
        raise ModelLoadError(
            f"cannot build {config_class.__name__} (the factory's {name!r}) from {rest}: {type(exc).__name__}: {exc}"
        ) from None


def _is_config_class(annotation) -> bool:
    from pydantic import BaseModel

    return isinstance(annotation, type) and (dataclasses.is_dataclass(annotation) or issubclass(annotation, BaseModel))


def build_model(
    spec: str,
    config: dict[str, Any],
    *,
    abstract: bool = True,
    seed: int = 0,
    on_built=None,
    paths: tuple[str, ...] = (),
    notice=None,
    eager: bool = False,
):
    """Call the factory with `config` (and `rngs=` if it takes one); abstract via `nnx.eval_shape`.

    `config` keys the factory does not take fill its config object (see `config_arguments`).
    `on_built(module)` sees the freshly built module, before `eval_shape` rebuilds it abstractly
    (which sorts its attributes: read definition order there).

    A factory that cannot be traced (its constructor mutates an `nnx.Rngs` made outside it, such as a
    default argument, or branches on a random value) is built eagerly on the CPU instead, and
    `notice(message)` is told so in one line; `eager` builds it so without trying (`--eager`).
    """
    factory = resolve_factory(spec, paths)
    wants_rngs = _accepts_rngs(factory)
    arguments = config_arguments(factory, config)

    def construct():
        # Rngs are made inside the construction so that eval_shape traces them too.
        module = factory(**arguments, **({"rngs": nnx.Rngs(seed)} if wants_rngs else {}))
        if not isinstance(module, nnx.Module):
            raise NotAModule(f"model factory {spec!r} returned a {type(module).__name__}, not a flax.nnx.Module")
        if on_built is not None:
            on_built(module)
        return module

    def failed(exc: BaseException, how: str = "") -> ModelLoadError:
        if isinstance(exc, SystemExit):
            return ModelLoadError(f"model factory {spec!r} called sys.exit({exc.code!r}) instead of returning a model")
        if isinstance(exc, NotAModule):
            return ModelLoadError(str(exc))
        # the factory is the user's code: its complaint is about their config
        return ModelLoadError(f"model factory {spec!r} with config {config} failed{how}: {type(exc).__name__}: {exc}")

    if not abstract or eager:
        try:
            return _on_cpu(construct) if eager else construct()
        except (Exception, SystemExit) as exc:
            raise failed(exc, " (built eagerly on the CPU, --eager)" if eager else "") from None
    try:
        return eval_shape(construct)
    except (Exception, SystemExit) as exc:
        if not untraceable(exc):
            raise failed(exc) from None
        abstract_error = exc
    return _eager_instead(spec, construct, abstract_error, notice, failed)


def _on_cpu(construct):
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        return construct()


def _eager_instead(spec: str, construct, abstract_error: BaseException, notice, failed):
    """The model built for real on the CPU, after its abstract build failed for a trace reason."""
    import jax
    import numpy as np

    cause = f"{type(abstract_error).__name__}: {first_line(abstract_error)}".rstrip(": ")
    why = (
        f"model factory {spec!r} cannot be built abstractly (nnx.eval_shape: {cause}); this happens when its "
        "constructor uses an nnx.Rngs made outside it, such as a default argument `rngs=nnx.Rngs(0)`"
    )
    try:
        model = _on_cpu(construct)
    except (Exception, SystemExit) as exc:
        raise ModelLoadError(
            f"{why}; building it eagerly on the CPU failed too ({type(exc).__name__}: "
            f"{first_line(exc)}). Way out: pass `rngs` on to every "
            "submodule the factory builds (or give the factory an `rngs` argument), so that it "
            "builds abstractly"
        ) from None
    leaves = [x for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if hasattr(x, "shape")]
    size = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)
    shown = f"{size / 2**20:,.2f} MiB" if size >= 2**20 else f"{size / 2**10:,.1f} KiB"
    if notice is not None:
        notice(
            f"{why}; built it eagerly on the CPU instead ({sum(int(np.prod(x.shape)) for x in leaves):,} "
            f"parameters, {shown}); --eager skips the abstract try"
        )
    return model
