"""The step's runtime pieces: plan specs as `PartitionSpec`s, layer calls split for microbatches,
accumulation, step options, the optimizer's state, precision, explicit mesh axes, compiled collectives
read back, and `jit_step`."""
