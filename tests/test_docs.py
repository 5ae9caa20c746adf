"""The examples in public docstrings run (on the 8 simulated devices) and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["shardplan.plan.schema", "shardplan.checks.layout", "shardplan.checks.mesh", "shardplan.run.hlo", "shardplan.checks.paths",
           "shardplan.plan.loader", "shardplan.checks.report", "shardplan.run.apply", "shardplan.run.specs", "shardplan.planner.roles", "shardplan.planner.auto",
           "shardplan.plan.matching", "shardplan.planner.profiles", "shardplan.plan.inert", "shardplan.run.models", "shardplan.run.pipeline", "shardplan.checks.diff"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
