"""What a training program needs besides its plan, as `minigpt train` uses it: joining a multi-process
run, stopping on a preemption notice after a save, Ctrl-C that waits for a checkpoint, checkpoints that
do not depend on the plan, and building a model named on the command line.

>>> from shardplan import training
>>> training.EXIT_PREEMPTED
75
"""

from shardplan.compose.restore import CheckpointMismatch, restore_checkpoint
from shardplan.pipeline.loop import cross_entropy
from shardplan.pipeline.pipelined import pipelined_tree, plain_tree
from shardplan.model.abstract import eval_shape
from shardplan.processes.devices import DeviceSetupError, has_accelerator
from shardplan.processes.distributed import SIBLING_GRACE_S, initialize, lost_a_peer
from shardplan.processes.interrupts import interrupt_once, interrupts_deferred
from shardplan.model.factory import ModelLoadError, parse_overrides
from shardplan.run.optimizer import load_plain_state, plain_abstract, plain_state
from shardplan.processes.preemption import EXIT_PREEMPTED, Preempted, PreemptionWatch

__all__ = [
    "CheckpointMismatch",
    "EXIT_PREEMPTED",
    "SIBLING_GRACE_S",
    "DeviceSetupError",
    "ModelLoadError",
    "Preempted",
    "PreemptionWatch",
    "cross_entropy",
    "eval_shape",
    "has_accelerator",
    "initialize",
    "interrupt_once",
    "interrupts_deferred",
    "load_plain_state",
    "lost_a_peer",
    "parse_overrides",
    "pipelined_tree",
    "plain_abstract",
    "plain_state",
    "plain_tree",
    "restore_checkpoint",
]
