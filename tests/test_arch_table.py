"""docs/operations.md's architecture table is what tools/arch_table.py prints from the
rules the code follows: a rule that moves moves the doc in the same commit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_architecture_table_is_the_one_the_rules_print() -> None:
    spec = importlib.util.spec_from_file_location("arch_table", ROOT / "tools" / "arch_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = (ROOT / "docs" / "operations.md").read_text()
    begin, end = doc.index(module.BEGIN), doc.index(module.END) + len(module.END) + 1
    assert doc[begin:end] == module.table(), "run python3 tools/arch_table.py into the doc"
