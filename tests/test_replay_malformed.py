"""`gms replay` answers every malformed journal with a clear error (issue 48: 4 of
150 edited journals ended in a traceback: a struct.error, a TypeError, an
unhashable list).  Saved journals are edited the ways a person or a broken disk
would (a value of another type, a field dropped, a line cut, a kind renamed, an
image's hex flipped); replay either rebuilds a state or raises LogFileError or
InvariantViolation, which the command turns into a message and exit 2."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from gms.fsm import InvariantViolation
from gms.operator.postmortem import LogFileError, replay_rows

from .handover_fixtures import rich_log, saved_journal

ODD_VALUES = [None, [], {}, "x", "zz", -1, 2**70, 1.5, True, {"a": [1]}, [["k", 1]], {"": {"q": "x"}}, "ff" * 9]


CUT = 12


def journal(tmp_path) -> list[str]:
    with open(saved_journal(tmp_path, list(rich_log().entries()), CUT)) as f:
        return f.read().splitlines()


def mutate(lines: list[str], rng: random.Random) -> list[str]:
    lines = list(lines)
    n = rng.randrange(1, len(lines))
    how = rng.choice(["value", "value", "value", "drop", "cut", "kind", "hex", "swap"])
    if how == "cut":
        lines[n] = lines[n][: rng.randrange(len(lines[n]))]
        return lines
    if how == "swap":
        m = rng.randrange(1, len(lines))
        lines[n], lines[m] = lines[m], lines[n]
        return lines
    row = json.loads(lines[n])
    key = rng.choice(sorted(row))
    if how == "drop":
        del row[key]
    elif how == "kind":
        row["kind"] = rng.choice(["RW_COMMIT", "SERVER_STARTED", "METADATA_PUT", "NOPE", 7])
    elif how == "hex" and "image" in row:
        data = bytearray(bytes.fromhex(row["image"]))
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        row["image"] = data.hex()
    else:
        row[key] = rng.choice(ODD_VALUES)
    lines[n] = json.dumps(row)
    return lines


def test_every_edited_journal_is_rebuilt_or_refused_with_a_message(tmp_path):
    lines = journal(tmp_path)
    assert replay_rows(lines).last_seq == len(lines) - 2 + CUT  # the untouched journal replays
    rng = random.Random(48)
    outcomes = {"rebuilt": 0, "refused": 0}
    for _ in range(600):
        edited = mutate(lines, rng)
        try:
            replay_rows(edited)
        except (LogFileError, InvariantViolation) as refused:
            assert str(refused), "a refusal says why"
            outcomes["refused"] += 1
        else:
            outcomes["rebuilt"] += 1
    assert outcomes["refused"] > 300, outcomes


@pytest.mark.parametrize("edit", [
    {"layout_slot": [1, 2]},        # was: TypeError deep in the fold
    {"kind": {"not": "a name"}},    # was: an unhashable dict
    {"allocation_id": ["a"]},       # was: an unhashable list
])
def test_gms_replay_says_what_is_wrong_and_exits_2(tmp_path, edit):
    lines = journal(tmp_path)
    for n, line in enumerate(lines):
        row = json.loads(line)
        if set(edit) <= set(row):
            row.update(edit)
            lines[n] = json.dumps(row)
            break
    else:
        pytest.fail(f"no row has {set(edit)}")
    path = tmp_path / "edited.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "gms", "replay", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("gms replay: ") and "Traceback" not in out.stderr, out
