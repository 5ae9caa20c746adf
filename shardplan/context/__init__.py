"""Context parallelism: the sequence split over a mesh axis (the plan's `context:` section).

`check.py` checks the section against the mesh and the inputs; `install.py` puts it on the user's model without touching its code: `all_gather` constrains the
outputs of each attention's query projection to stay split over the sequence and those of its key
and value projections to be whole (so XLA gathers them), as read from the parameters' roles; `ring`
replaces the attention functions the model calls by `ring.py`'s blockwise attention. `layout.py`
orders the sequence for load balancing; `contract.py` checks, by tracing one call, that the model's
code allows what the plan asks; `cost.py` is what it costs, for the cost model.
"""
