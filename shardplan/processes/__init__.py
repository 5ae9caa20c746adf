"""The devices and processes a run has: simulated CPU devices (`devices.py`), `jax.distributed`
(`distributed.py`), the XLA flags the time model assumes (`flags.py`), signals deferred while state is
written (`interrupts.py`) and preemption agreed on by every process (`preemption.py`)."""
