"""gms/fsm is the functional core: it may import only pure libraries."""

from __future__ import annotations

import ast
from pathlib import Path

import gms.fsm
from gms.fsm import EVENT_TYPES, RULES
from gms.fsm.events import ReaderJoined, ReaderLeft, ServerStarted

ALLOWED = {
    "__future__", "attrs", "immutables", "enum", "hashlib", "struct", "re", "collections",
    "collections.abc", "typing", "operator",
}


def test_fsm_imports_nothing_impure():
    for path in Path(gms.fsm.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            assert set(names) <= ALLOWED, f"{path.name} imports {names}"


def test_fold_is_total_over_event_types_and_every_event_has_one_rule():
    layout_steps = {kind for kind, rule in RULES.items() if rule.step is not None}
    node_steps = {kind for kind, rule in RULES.items() if rule.node_step is not None}
    # a reader's joining and leaving are their pairs' steps in one row; nothing else has two
    assert layout_steps & node_steps == {ReaderJoined, ReaderLeft}, "each event is folded in one place"
    assert layout_steps | node_steps | {ServerStarted} == set(EVENT_TYPES.values())
    assert set(RULES) == set(EVENT_TYPES.values()) - {ServerStarted}, "the table covers every event"
