"""A seeded mutation fuzzer over the plan commands: shipped plans, profiles and rule files, mutated, run
through every command that reads them, each call required to end in exit 0, 1 or 2 with no traceback,
no control characters, bounded output and bounded work (`python -m tests.mutations --help`)."""
