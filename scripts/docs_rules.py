"""Rewrite the rules table and its diagrams in docs/architecture.md from gms/fsm/rules.py.

    python scripts/docs_rules.py          # rewrite the generated block
    python scripts/docs_rules.py --check  # exit 1 if the docs differ from the table
"""

from __future__ import annotations

import sys
from pathlib import Path

from gms.fsm import diagram

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def rewritten(text: str) -> str:
    start, end = text.index(diagram.BEGIN), text.index(diagram.END) + len(diagram.END)
    return text[:start] + diagram.block() + text[end:]


def main() -> int:
    text = DOC.read_text()
    new = rewritten(text)
    if "--check" in sys.argv:
        return 0 if new == text else 1
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
