"""Expert parallelism: the plan's `experts:` section on the user's own mixture-of-experts blocks.

`roles.py` finds routers and expert stacks from shapes; `check.py` checks the section against them and
the mesh; `contract.py` checks by an abstract trace that a block's code can run expert-parallel;
`block.py`, `interpret.py`, `dense.py` and `exchange.py` run it; `cost.py` is what it costs.
"""
