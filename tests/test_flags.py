"""`shardplan.set_performance_flags`: the GPU flags the time model assumes, set only where a GPU will run."""

import importlib.util

import shardplan
from shardplan.run import flags


def test_nothing_is_set_without_a_gpu(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert shardplan.performance_flags("cpu") == [] and shardplan.performance_flags("tpu") == []
    assert shardplan.set_performance_flags() == []          # this machine has no GPU plugin
    assert "XLA_FLAGS" not in __import__("os").environ


def test_gpu_flags_added_once_keeping_the_users_own(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(flags.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "jax_cuda12_plugin" else real(name, *a))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    added = shardplan.set_performance_flags()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in added       # the user's choice stands
    assert "--xla_gpu_enable_pipelined_all_gather=true" in added
    import os
    assert os.environ["XLA_FLAGS"].count("latency_hiding") == 1
    assert shardplan.set_performance_flags() == []                             # idempotent
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert shardplan.set_performance_flags() == []                             # CPU asked for: nothing
