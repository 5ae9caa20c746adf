"""The model under a plan: one (plan, model) as every check and install that needs the model's own
code reads it.

Each parallelism's folder (and the step options') owns a `model_checks(subject, found)` and, where it
changes the model, an `install_on_model(subject)`, each reading what it needs from here;
`shardplan.compose` runs them in turn. What more than one of them needs (the example call, the mesh to
trace on, the attention roles, the module paths) is worked out here once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from shardplan.plan.diagnostics import Diagnostic
from shardplan.plan.schema import Plan


@dataclasses.dataclass
class ModelUnderPlan:
    plan: Plan
    model: Any  # an nnx.Module, live or abstract
    report: Any  # the plan-only `shardplan.review.report.Report` (a floor above this one)
    example: Callable | None = None  # the caller's example call, if any
    given_mesh: Any = None  # the caller's mesh; None: a mesh of the plan's axes to trace on
    given_roles: Any = None  # `shardplan.core.roles.ModelRoles` the caller read (an abstract model's order is lost)

    @functools.cached_property
    def call(self) -> Callable | None:
        """The example call (given, else zeros shaped as the plan's inputs), for the plans whose checks
        trace the forward: pipelines, activation rules, experts, context."""
        plan, report = self.plan, self.report
        if self.example is not None:
            return self.example
        if report.stage_map is None and not plan.activations and not report.experts and not plan.context:
            return None
        from shardplan.core.calls import example_call

        return example_call(plan, self.model)

    @functools.cached_property
    def mesh(self):
        """The given mesh, else one of the plan's axes (devices this machine need not have, as the layout is)."""
        if self.given_mesh is not None:
            return self.given_mesh
        from shardplan.core.mesh import tracing_mesh

        return tracing_mesh(self.plan, self.report.axes)

    @functools.cached_property
    def roles(self):
        """What the model's parameters are (attention projections among them): given, else read from it."""
        if self.given_roles is not None:
            return self.given_roles
        from shardplan.core.roles import recognise_module

        return recognise_module(self.model)

    @functools.cached_property
    def module_paths(self) -> list[str]:
        from shardplan.core.paths import module_paths

        return [path for path, _ in module_paths(self.model)]

    @property
    def specs(self) -> dict[str, tuple]:
        """Each parameter's spec, as the plan places it."""
        return {layout.path: layout.spec for layout in self.report.params}

    @property
    def plan_errors(self) -> bool:
        return bool(self.report.errors)


ModelCheck = Callable[[ModelUnderPlan, list[Diagnostic]], list[Diagnostic]]
