"""The differential combination tester: random valid and invalid plans over three small decoders,
each case run in a worker process and compared with one device.

- `models.py`: the decoders (LLaMA-style, GPT-2-style with a tied head, MoE in three forms);
- `generate.py`: random cases (mesh, rules, every option of the plan format; a known mistake and its code);
- `run.py`: one case: `check`, then two AdamW steps against one device (loss, gradients, parameters);
- `pool.py`: worker processes, so that an abort or a hang is recorded, not fatal;
- `minimise.py`: a failing case shrunk to the smallest plan that still fails the same way;
- `__main__.py`: `python -m tests.combinations --cases 1000` prints `N cases, P passed, F failed`, saves
  each failure as a plan file with its one-line repro, and `--replay FILE` runs one again.
"""
