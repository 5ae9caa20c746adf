"""A plan reviewed whole against a model and a mesh: the core's checks and each parallelism's own
(`pipeline/stages.py`, `experts/check.py`, `context/check.py`) gathered into one `Report`, and the
difference of two reports device by device."""
