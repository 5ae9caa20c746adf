"""Checking a plan against a model and a mesh, pure: validation, shard arithmetic, stages, the report, diffs."""
