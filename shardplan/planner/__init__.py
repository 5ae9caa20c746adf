"""Planning: parameter roles, the cost model, device profiles, HLO counting and the `auto` search."""
