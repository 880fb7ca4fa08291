"""tools/structure.py finds what it is for, on small trees written for each test."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structure", ROOT / "tools" / "structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["structure"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


structure = _load()

LAYERS = {"meshd": set(), "crdt": set(), "node": {"crdt"}, "api": {"node", "crdt"}}
RULES = {("node", "api"): "node never imports api"}


def tree(tmp_path: Path, files: dict[str, str]):
    for name, text in {"meshd/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return structure.scan(tmp_path)


def layering(t, **tables):
    kw = {"allowed": LAYERS, "forbidden": RULES, "known_breaks": {}, "surfaces": {}, "shared": ()}
    return structure.check_layering(t, **{**kw, **tables})


def sizes(t, **tables):
    kw = {"module_sizes": {}, "function_sizes": {}, "exempt": ()}
    return structure.check_sizes(t, **{**kw, **tables})


CLEAN = {
    "meshd/crdt/__init__.py": "from .lww import Entry\n",
    "meshd/crdt/lww.py": "class Entry:\n    pass\n",
    "meshd/node/__init__.py": "",
    "meshd/node/state.py": "from meshd.crdt import Entry\nfrom . import cards\n",
    "meshd/node/cards.py": "from meshd.crdt.lww import Entry\n",
    "meshd/api/__init__.py": "",
    "meshd/api/app.py": "from ..node.state import Entry\nfrom meshd.crdt import lww\n",
}


def test_clean_tree_passes(tmp_path):
    t = tree(tmp_path, CLEAN)
    assert layering(t) == []
    assert structure.check_cycles(t) == []
    assert sizes(t) == ([], [])
    # Relative imports resolve to the modules they name.
    targets = {(i.module, i.target) for i in t.imports}
    assert ("meshd.api.app", "meshd.node.state") in targets
    assert ("meshd.api.app", "meshd.crdt.lww") in targets
    assert ("meshd.node.state", "meshd.node.cards") in targets


def test_upward_import_is_found_with_its_line_and_rule(tmp_path):
    t = tree(
        tmp_path,
        {
            **CLEAN,
            "meshd/node/cards.py": "import json\n\n\ndef f():\n    from meshd.api.app import x\n",
        },
    )
    problems = layering(t)
    assert problems == [
        "meshd/node/cards.py:5: meshd.node may not import meshd.api (meshd.api.app.x): "
        "node never imports api"
    ]
    # And the arrow node -> crdt, which cards.py took alone, is now unused.
    t2 = tree(tmp_path, {**CLEAN, "meshd/node/state.py": "", "meshd/node/cards.py": ""})
    assert any("no import takes node -> crdt" in p for p in layering(t2))


def test_type_checking_import_counts_for_layering(tmp_path):
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from meshd.api import app\n"
    t = tree(tmp_path, {**CLEAN, "meshd/crdt/hlc.py": src})
    (imp,) = [i for i in t.imports if i.module == "meshd.crdt.hlc"]
    assert imp.kind == "type-checking"
    assert any(p.startswith("meshd/crdt/hlc.py:3: meshd.crdt may not import") for p in layering(t))


def test_known_break_is_allowed_and_must_shrink(tmp_path):
    t = tree(tmp_path, {**CLEAN, "meshd/crdt/hlc.py": "from meshd.node.cards import Entry\n"})
    key = "meshd/crdt/hlc.py: meshd.node.cards.Entry"
    assert layering(t, known_breaks={key: "moving"}) == []
    gone = "meshd/crdt/lww.py: meshd.node.cards.Entry"
    assert layering(t, known_breaks={key: "moving", gone: "fixed"}) == [
        f"tools/structure.py: KNOWN_BREAKS: {gone} is gone: remove this entry"
    ]


def test_surface_limits_which_modules_an_arrow_reaches(tmp_path):
    t = tree(tmp_path, CLEAN)
    problems = layering(t, surfaces={("api", "node"): {"meshd.node.cards"}})
    assert any(
        "meshd/api/app.py:1: meshd.api reaches meshd.node only through" in p for p in problems
    )
    assert any("meshd.node.cards is no longer imported" in p for p in problems)


def test_unknown_package_is_reported(tmp_path):
    t = tree(tmp_path, {**CLEAN, "meshd/domain/__init__.py": ""})
    assert any("meshd.domain is in no layer" in p for p in layering(t))


def test_pure_package_may_not_do_io(tmp_path):
    src = """\
        import os.path as osp
        from time import monotonic


        def f(path):
            print(osp.join(path, "x"))
            return open(path).read()
    """
    t = tree(tmp_path, {**CLEAN, "meshd/crdt/hlc.py": src})
    banned = {"crdt": (("os", "builtins.open", "builtins.print"), "crdt is pure")}
    problems = layering(t, banned=banned)
    assert "meshd/crdt/hlc.py:1: uses os.path: crdt is pure" in problems
    assert "meshd/crdt/hlc.py:6: uses os.path.join: crdt is pure" in problems
    assert "meshd/crdt/hlc.py:6: uses builtins.print: crdt is pure" in problems
    assert "meshd/crdt/hlc.py:7: uses builtins.open: crdt is pure" in problems
    assert not any("time" in p for p in problems)


def test_process_starters_match_by_prefix(tmp_path):
    src = "import os\n\n\ndef f():\n    os.execvp('x', [])\n    os.environ.get('A')\n"
    t = tree(tmp_path, {**CLEAN, "meshd/crdt/hlc.py": src})
    problems = layering(t, banned={"crdt": (("os.exec*",), "starts nothing")})
    assert problems == ["meshd/crdt/hlc.py:5: uses os.execvp: starts nothing"]


def test_cycle_is_found_even_through_a_function_import(tmp_path):
    t = tree(
        tmp_path,
        {
            **CLEAN,
            "meshd/node/cards.py": "from meshd.crdt.lww import Entry\nfrom . import peers\n",
            "meshd/node/peers.py": "def f():\n    from meshd.node.cards import Entry\n",
        },
    )
    (problem,) = structure.check_cycles(t)
    assert problem.startswith("meshd/node/cards.py:2: import cycle: ")
    assert "meshd.node.cards -> meshd.node.peers (meshd/node/cards.py:2)" in problem
    assert (
        "meshd.node.peers -> meshd.node.cards (meshd/node/peers.py:2, function import)" in problem
    )


def test_package_init_reexport_is_no_cycle(tmp_path):
    # crdt/__init__ imports lww; lww importing a sibling through the package would be one.
    t = tree(tmp_path, CLEAN)
    assert structure.check_cycles(t) == []
    t = tree(tmp_path, {**CLEAN, "meshd/crdt/lww.py": "from meshd.crdt import Entry\n"})
    assert len(structure.check_cycles(t)) == 1


def _function(name: str, lines: int) -> str:
    return f"def {name}():\n" + "    x = 1\n" * (lines - 1)


def test_oversize_function_and_module_are_found(tmp_path):
    src = "class A:\n" + textwrap.indent(_function("big", 81), "    ") + _function("ok", 80)
    t = tree(tmp_path, {**CLEAN, "meshd/node/cards.py": src})
    problems, notes = sizes(t, module_limit=100)
    assert problems == [
        "meshd/node/cards.py:1: module is 162 lines (limit 100): split it",
        "meshd/node/cards.py:2: A.big is 81 lines (limit 80): split it",
    ]
    assert notes == []


def test_size_ratchet(tmp_path):
    t = tree(tmp_path, {**CLEAN, "meshd/node/cards.py": _function("big", 90)})
    key = "meshd/node/cards.py::big"
    assert sizes(t, function_sizes={key: 90}) == ([], [])
    problems, _ = sizes(t, function_sizes={key: 89})
    assert problems == [
        "meshd/node/cards.py:1: big grew to 90 lines; it may not pass its listed 89 "
        "(limit 80): split it"
    ]
    assert sizes(t, function_sizes={key: 95}) == (
        [],
        ["meshd/node/cards.py:1: big shrank to 90 lines (listed 95)"],
    )
    problems, _ = sizes(t, function_sizes={key: 90}, function_limit=90)
    assert problems == [
        "meshd/node/cards.py:1: big is 90 lines, within the limit 90: remove its entry "
        "from tools/structure.py"
    ]
    problems, _ = sizes(t, function_sizes={key: 90, "meshd/node/gone.py::f": 100})
    assert problems == [
        "tools/structure.py: FUNCTION_SIZES: meshd/node/gone.py::f is gone: remove this entry"
    ]


def test_temporary_exemption_covers_a_file_or_a_folder_present_or_not(tmp_path):
    t = tree(tmp_path, {**CLEAN, "meshd/node/run/a.py": _function("big", 500)})
    exempt = ("meshd/node/run.py", "meshd/node/run/")
    assert sizes(t, exempt=exempt) == ([], [])
    assert len(sizes(t)[0]) == 2


def test_shared_unit_is_importable_by_all_and_imports_nothing(tmp_path):
    files = {
        **CLEAN,
        "meshd/nouns/__init__.py": "",
        "meshd/crdt/hlc.py": "from meshd import nouns\n",
    }
    t = tree(tmp_path, files)
    layers = {**LAYERS, "nouns": set()}
    assert layering(t, allowed=layers, shared={"nouns"}) == []
    assert any("may not import meshd.nouns" in p for p in layering(t, allowed=layers))
    assert structure.check_tables(layers, RULES, {"nouns"}) == []
    assert structure.check_tables({**layers, "nouns": {"crdt"}}, RULES, {"nouns"}) == [
        "tools/structure.py: nouns is SHARED (anyone imports it), so it may import nothing"
    ]


def test_tables_are_checked(tmp_path):
    assert structure.check_tables(LAYERS, RULES, ()) == []
    bad = {**LAYERS, "node": {"crdt", "api"}}
    assert structure.check_tables(bad, RULES, ()) == [
        "tools/structure.py: ALLOWED has node -> api, which a rule forbids: node never imports api",
        "tools/structure.py: ALLOWED has a cycle: api -> node -> api",
    ]


def test_the_real_tables_are_a_dag_without_a_forbidden_arrow():
    assert structure.check_tables(structure.ALLOWED, structure.FORBIDDEN) == []


def test_the_repository_holds(capsys):
    assert structure.main([str(ROOT)]) == 0, capsys.readouterr().out
