"""The examples in public docstrings run (on the 8 simulated devices) and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["shardplan.schema", "shardplan.layout", "shardplan.mesh", "shardplan.hlo", "shardplan.paths",
           "shardplan.loader", "shardplan.report", "shardplan.apply", "shardplan.roles", "shardplan.auto",
           "shardplan.matching", "shardplan.models", "shardplan.pipeline", "shardplan.diff"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
