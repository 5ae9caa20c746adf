"""`shardplan.set_performance_flags`: the GPU flags the time model assumes, set only where a GPU will run."""

import importlib.util
from pathlib import Path

import pytest

import shardplan
from shardplan.processes import flags


def test_nothing_is_set_without_a_gpu(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert shardplan.performance_flags("cpu") == [] and shardplan.performance_flags("tpu") == []
    assert shardplan.set_performance_flags() == []  # this machine has no GPU plugin
    assert "XLA_FLAGS" not in __import__("os").environ


@pytest.fixture
def gpu_plugin(monkeypatch):
    """As if a CUDA plugin were installed (only its presence is looked up) and no platform asked for."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        flags.importlib.util, "find_spec", lambda name, *a: object() if name == "jax_cuda12_plugin" else real(name, *a)
    )
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)


def test_gpu_flags_added_once_keeping_the_users_own(monkeypatch, gpu_plugin):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    added = shardplan.set_performance_flags()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in added  # the user's choice stands
    assert "--xla_gpu_enable_pipelined_all_gather=true" in added
    import os

    assert os.environ["XLA_FLAGS"].count("latency_hiding") == 1
    assert shardplan.set_performance_flags() == []  # idempotent
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert shardplan.set_performance_flags() == []  # CPU asked for: nothing


def test_a_plans_tensor_overlap_adds_the_collective_matmul_flags(monkeypatch, gpu_plugin):
    monkeypatch.setenv("XLA_FLAGS", "")
    plan = shardplan.parse_plan(OVERLAP_PLAN)
    assert "--xla_gpu_threshold_for_windowed_einsum_mib=0" not in shardplan.set_performance_flags()
    monkeypatch.setenv("XLA_FLAGS", "")
    added = shardplan.set_performance_flags(plan)
    assert added[-2:] == [
        "--xla_gpu_threshold_for_windowed_einsum_mib=0",
        "--xla_gpu_multi_streamed_windowed_einsum=true",
    ]
    assert flags.tensor_overlap_in_effect("gpu") is None
    assert "GPUs only" in flags.tensor_overlap_in_effect("cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert "set_performance_flags(plan)" in flags.tensor_overlap_in_effect("gpu")


OVERLAP_PLAN = """version: 1
mesh: {axes: {data: 2, model: 4}}
inputs: {tokens: [data, null]}
params:
  - {match: '.*(query|key|value|linear1)/kernel', spec: [null, model]}
  - {match: '.*(out|linear2)/kernel', spec: [model, null]}
  - {match: '.*', spec: replicated}
activations:
  - {match: 'transformer_blocks/\\d+/layer_norm[12]', spec: [data, model, null]}
tensor_overlap: true
"""

# Compiles MiniGPT's sequence-parallel step on 8 CPU devices with XLA_FLAGS as given and prints its
# collectives; a flag this jax's XLA does not know aborts the process before that.
_COMPILE = """
import json, sys, warnings
import jax, optax, shardplan, minigpt_model
from flax import nnx
from shardplan.run.hlo import collective_stats
from shardplan.compose.measure import lm_train_step
plan = shardplan.parse_plan(sys.argv[1])
mesh = shardplan.make_mesh(plan)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = shardplan.apply_plan(plan, minigpt_model.MiniGPT(maxlen=16, vocab_size=64, embed_dim=32, num_heads=4,
                                 feed_forward_dim=64, num_transformer_blocks=2, rngs=nnx.Rngs(0)), mesh)
optimizer = shardplan.shard_optimizer(plan, model, optax.adamw(1e-3), mesh)
batch = shardplan.shard_inputs(plan, {"tokens": jax.numpy.zeros((8, 16), "int32")}, mesh)
step = nnx.jit(lm_train_step)
text = step.lower(model, optimizer, batch["tokens"], batch["tokens"]).compile().as_text()
print(json.dumps({"kinds": collective_stats(text).count,
                  "warnings": [str(w.message) for w in caught if "tensor_overlap" in str(w.message)]}))
"""


def test_the_overlap_flags_are_this_jaxs_own_and_do_nothing_on_cpu(tmp_path):
    """The names are checked by XLA itself (it aborts on a flag it does not know): on CPU they compile
    the same step, and `apply_plan` says that tensor_overlap does nothing there."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]

    def compiled(xla_flags: str):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            PYTHONPATH=str(repo),
            XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {xla_flags}",
        )
        return subprocess.run(
            [sys.executable, "-c", _COMPILE, OVERLAP_PLAN],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )

    plain = compiled("")
    with_flags = compiled(" ".join(shardplan.performance_flags("gpu", tensor_overlap=True)))
    assert plain.returncode == 0 and with_flags.returncode == 0, with_flags.stderr[-2000:]
    plain, with_flags = json.loads(plain.stdout), json.loads(with_flags.stdout)
    assert with_flags["kinds"] == plain["kinds"] and plain["kinds"]
    assert any("GPUs only" in w for w in with_flags["warnings"])
    unknown = compiled("--xla_gpu_threshold_for_windowed_einsum_mib_typo=0")
    assert unknown.returncode != 0 and "Unknown flag" in unknown.stderr
