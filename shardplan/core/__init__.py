"""The shared core, pure: parameter paths and roles, the mesh, shard arithmetic, the placement rules'
validation, and the contracts a model's calls must keep. Every parallelism builds on it."""
