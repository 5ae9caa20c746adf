"""Expert parallelism: the plan's `experts:` section on the user's own mixture-of-experts blocks."""
