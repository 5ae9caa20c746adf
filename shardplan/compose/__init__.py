"""The plan and the model brought together, above the feature folders (`pipeline/`, `experts/`,
`context/`) that this floor composes: `check.py` (`check`: the review of `review/` and the
contracts each feature checks on the model's own code), `apply.py` (placement: `apply_plan`,
`shard_optimizer`, `shard_inputs`, `init`), `measure.py` (one step compiled; its collectives and
memory read back).
"""
