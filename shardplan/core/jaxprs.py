"""Walking a traced program. Pure."""

from __future__ import annotations


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (jit, scan, cond, checkpoint, custom derivatives)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)
