"""Pipelines: the plan's `pipeline:` section, from its checks to the step it runs and what it costs.

`stages.py` checks the section against the model's layers and assigns them to stages; `schedules.py`
holds the schedules as data (the tables the loop runs, their timelines and bubbles); `cost.py` is what a
schedule costs, for the cost model. `pipelined.py` replaces the model's layer list by `PipelinedLayers`
(the model keeps its class and its forward); `loop.py` runs the stacked layers under the schedule's
tables, with `zero_bubble.py` and `split_backward.py` for ZB-H1, `zero_bubble_v.py` for the V schedule
(two chunks per device), and `branch_probe.py` deciding whether idle ticks may be skipped on this
backend.
"""
