"""The mutation fuzzer (tests/mutations) on a fixed sample: shipped plans, profiles and rule files,
mutated, through every command that reads them; each call ends in exit 0, 1 or 2 with no traceback, no
control character, bounded output and bounded work. `python -m tests.mutations --calls 2000` is the
long run."""

import collections

from tests.combinations.pool import run_all
from tests.mutations.__main__ import FAILURES, WORKER
from tests.mutations.generate import calls

SAMPLE = 120


def test_a_fixed_sample_of_mutated_files_through_every_command_ends_cleanly():
    todo = calls(0, SAMPLE)
    results = run_all(todo, jobs=1, timeout=600, script=WORKER)
    failed = [
        (call["id"], call["argv"], result["detail"][:400])
        for call, result in zip(todo, results)
        if result["status"] in FAILURES
    ]
    assert not failed
    commands = {call["command"] for call in todo}
    assert commands == {"validate", "inspect", "explain", "diff", "params", "export", "profiles", "auto", "convert"}
    exits = collections.Counter(result["exit"] for result in results)
    assert exits[0] and exits[1] and exits[2], exits  # accepted, refused and unreadable files all drawn
