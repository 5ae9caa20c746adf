"""Training under plans: same losses as one device, resharding restores, bad input (exact resumes after a
kill: tests/test_preemption.py)."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

import shardplan
from minigpt_model import cli
from minigpt_model.checkpoint import Checkpoints, restore_for_inference
from minigpt_model.model import MiniGPT
from minigpt_model.sampling import _generate, generate
from minigpt_model.trainer import TrainConfig, train

from conftest import PLANS, full

# Heads, widths and the 320-token byte vocabulary all divide 8, so every shipped plan applies.
TINY = dict(maxlen=32, embed_dim=64, num_heads=8, feed_forward_dim=128, num_transformer_blocks=2, dropout_rate=0.0)
TINY_ARGS = [f"--config={k}={v}" for k, v in TINY.items()]
REL_TOL = 2e-4  # 20 AdamW steps in float32 with different reduction orders per plan


def tiny_config(out, **changes) -> TrainConfig:
    settings = dict(
        out=str(out),
        steps=20,
        batch_size=16,
        lr=3e-3,
        warmup_steps=5,
        eval_every=10,
        eval_batches=2,
        checkpoint_every=10,
        model=TINY,
        sample_tokens=0,
    )
    return TrainConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    result = train(tiny_config(out / "run", plan=str(PLANS / "minigpt_dp.yaml")), devices=jax.devices()[:1])
    return np.array([result.losses[s] for s in range(1, 21)])


# Each shipped plan's steps equal one device's in test_apply.py; here the trainer runs on them (FSDP by
# default, the others and accumulation over data x tensor below).
@pytest.mark.parametrize(
    "plan", [full("minigpt_dp.yaml"), full("minigpt_tp.yaml"), full("minigpt_dp_tp.yaml"), "minigpt_fsdp.toml"]
)
def test_twenty_steps_match_one_device(tmp_path, plan, one_device_losses):
    result = train(tiny_config(tmp_path / "run", plan=str(PLANS / plan)))
    losses = np.array([result.losses[s] for s in range(1, 21)])
    np.testing.assert_allclose(losses, one_device_losses, rtol=REL_TOL)
    assert losses[-1] < losses[0] - 1.0  # it learns
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21)) and "eval_loss" in records[9]


def test_accumulated_training_matches_one_device_sample_included(tmp_path, one_device_losses):
    """What users run: the trainer on a plan with accumulation, its default sample at the end."""
    plan = tmp_path / "accumulate.yaml"
    plan.write_text((PLANS / "minigpt_dp_tp.yaml").read_text() + "accumulate: 2\n")
    result = train(tiny_config(tmp_path / "run", plan=str(plan), sample_tokens=TrainConfig.sample_tokens))
    losses = np.array([result.losses[s] for s in range(1, 21)])
    np.testing.assert_allclose(losses, one_device_losses, rtol=2e-4)
    assert result.sample


def test_checkpoint_restores_under_another_plan_and_on_one_device(tmp_path):
    run = tmp_path / "run"
    first = train(tiny_config(run, plan=str(PLANS / "minigpt_dp_tp.yaml"), steps=10, checkpoint_every=10))
    saved = Checkpoints(run / "checkpoints")
    meta = saved.meta()
    assert meta["step"] == 10 and meta["model"]["embed_dim"] == 64

    def params_of(model):
        return {k: np.asarray(v) for k, v in jax.tree.leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}

    reference = MiniGPT(**meta["model"], rngs=nnx.Rngs(5))
    saved.restore(reference)
    fsdp = shardplan.load_plan(PLANS / "minigpt_fsdp.toml")
    mesh = shardplan.make_mesh(fsdp)
    resharded = shardplan.apply_plan(fsdp, MiniGPT(**meta["model"], rngs=nnx.Rngs(7)), mesh)
    saved.restore(resharded)
    assert resharded.output_layer.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "data")
    single, _, _ = restore_for_inference(run)
    for restored in (resharded, single):
        got = params_of(restored)
        for key, value in params_of(reference).items():
            np.testing.assert_array_equal(got[key], value)
    saved.close()
    # Training continues under FSDP from step 10.
    more = train(tiny_config(run, plan=str(PLANS / "minigpt_fsdp.toml"), steps=14, resume=True, checkpoint_every=14))
    assert sorted(more.losses) == [11, 12, 13, 14] and all(np.isfinite(list(more.losses.values())))
    assert max(first.losses) == 10


def test_interrupted_save_leaves_previous_checkpoint(tmp_path):
    """A save killed midway leaves only orbax's temporary directory, which restore ignores."""
    run = tmp_path / "run"
    train(tiny_config(run, steps=10, checkpoint_every=5))
    checkpoints = run / "checkpoints"
    partial = checkpoints / "15.orbax-checkpoint-tmp-1234567"
    partial.mkdir()
    (partial / "_CHECKPOINT_METADATA").write_text("{truncated")
    manager = Checkpoints(checkpoints)
    assert manager.latest_step() == 10
    assert manager.meta()["step"] == 10


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())  # rich wraps long messages


def test_bad_input_gets_clear_message_and_nothing_half_written(capsys, tmp_path):
    out = tmp_path / "run"
    base = ["train", "--out", str(out), "--steps", "2", "--batch-size", "8", *TINY_ARGS]
    code, _, err = run_cli(capsys, *base, "--data", str(tmp_path / "missing.txt"))
    assert code == 1 and "does not exist" in err and not out.exists()
    (tmp_path / "empty.txt").write_text("")
    code, _, err = run_cli(capsys, *base, "--data", str(tmp_path / "empty.txt"))
    assert code == 1 and "empty" in err and not out.exists()
    (tmp_path / "tiny.txt").write_text("One tiny story.")
    code, _, err = run_cli(capsys, *base, "--data", str(tmp_path / "tiny.txt"))
    assert code == 1 and "a batch needs 8 windows" in err and not out.exists()
    code, _, err = run_cli(capsys, *base, "--plan", "docs/examples/seed_tutorial.yaml")
    assert code == 1 and "spec-too-long" in err and not out.exists()

    code, _, _ = run_cli(capsys, *base)
    assert code == 0 and (out / "checkpoints" / "2").exists()
    code, _, err = run_cli(capsys, *base)
    assert code == 1 and "already holds a run" in err and "--resume" in err
    code, _, err = run_cli(capsys, *base, "--resume", "--config", "embed_dim=32")
    assert code == 1 and "different model shape" in err


def test_sampling_compiles_once_and_continues_the_prompt(capsys, tmp_path):
    model = MiniGPT(**{**TINY, "vocab_size": 320}, rngs=nnx.Rngs(0))
    before = _generate._cache_size()
    a = generate(model, list(b"Once upon"), maxlen=32, max_tokens=40, temperature=0.0)
    b = generate(model, list(b"A much longer prompt than that one"), maxlen=32, max_tokens=40, temperature=0.0)
    assert len(a) == len(b) == 40 and a == generate(
        model, list(b"Once upon"), maxlen=32, max_tokens=40, temperature=0.0
    )
    assert _generate._cache_size() == before + 1  # one program for every prompt length

    run = tmp_path / "run"
    train(tiny_config(run, steps=5, checkpoint_every=5))
    capsys.readouterr()
    code, out, _ = run_cli(
        capsys, "sample", "--checkpoint", str(run), "--prompt", "Once upon a time", "--max-tokens", "20"
    )
    assert code == 0 and out.startswith("Once upon a time")
    code, _, err = run_cli(capsys, "sample", "--checkpoint", str(tmp_path / "nothing"))
    assert code == 1 and "no checkpoints" in err


def test_pipelined_plan_trains_checkpoints_and_resumes(tmp_path, one_device_losses):
    """minigpt_3d (2 stages x 2 data x 2 model, 1f1b): stop at step 10, resume to 20 and write the sample
    at the end (it once crashed there), same losses as one device."""
    run = tmp_path / "run"
    config = tiny_config(run, plan=str(PLANS / "minigpt_3d.yaml"))
    first = train(config, stop_after=10)
    assert sorted(first.losses) == list(range(1, 11))
    rest = train(dataclasses.replace(config, resume=True, sample_tokens=8))
    assert sorted(rest.losses) == list(range(11, 21))
    assert rest.sample.startswith("Once upon a time") and len(rest.sample) > len("Once upon a time")
    got = {**first.losses, **rest.losses}
    np.testing.assert_allclose([got[s] for s in range(1, 21)], one_device_losses, rtol=REL_TOL)
    model, _, _ = restore_for_inference(run)  # checkpoints hold the unpipelined layout
    assert isinstance(model, MiniGPT)


# (minigpt_3d trains to its sample by default in the test above; the CLI trains and samples in test_hostile.py)
@pytest.mark.parametrize("plan", [full("minigpt_3d.yaml"), full("minigpt_pp4.yaml"), full("minigpt_dp_tp_sp.yaml")])
def test_shipped_pipeline_and_step_plans_train_to_the_end_sample_included(tmp_path, capsys, plan):
    """What users run: `minigpt train --plan ...` with its default sample at the end (it once crashed there)."""
    code, out, err = run_cli(
        capsys,
        "train",
        "--plan",
        f"plans/{plan}",
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "4",
        "--batch-size",
        "16",
        "--eval-every",
        "4",
        "--checkpoint-every",
        "4",
        *TINY_ARGS,
        "--config=num_transformer_blocks=4",
    )
    assert code == 0, err
    assert "sample: Once upon a time" in out and "done: step 4" in out
    code, out, err = run_cli(capsys, "sample", "--checkpoint", str(tmp_path / "run"), "--max-tokens", "8")
    assert code == 0 and out.startswith("Once upon a time"), err
