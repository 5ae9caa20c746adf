"""Pipelines: the plan's `pipeline:` section run on the user's own layer list, inside one compiled step.

`pipelined.py` replaces the model's layer list by `PipelinedLayers` (the model keeps its class and its
forward); `loop.py` runs the stacked layers under the schedule's tables (`checks/schedules.py`), with
`zero_bubble.py` and `split_backward.py` for ZB-H1, `zero_bubble_v.py` for the V schedule (two chunks
per device), and `branch_probe.py` deciding whether idle ticks may be skipped on this backend.
"""
