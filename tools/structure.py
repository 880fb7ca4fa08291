"""Structure check: the layering, import cycles and sizes docs/architecture.md states.

Run from the repository root (or anywhere): ``python3 tools/structure.py``. It reads
``meshd/**/*.py`` with ``ast`` (stdlib only, imports nothing from meshd), prints every
problem as ``file:line: what`` and exits 1; or prints one summary line and exits 0.
``.ci/run`` runs it before the tests.

Every table below is exact: an arrow, a surface module, a known break or a size entry
that the code no longer needs is reported too, so the tables (and the map in
docs/architecture.md, which draws ALLOWED) stay the truth about the code.
"""

from __future__ import annotations

import ast
import itertools
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "meshd"

# ---------------------------------------------------------------------------------
# Layering. A unit is a top-level package of meshd (``crdt``, ``node``...) or one of
# its top-level modules (``logs``; ``meshd`` is meshd/__init__.py, ``__version__``).
# ALLOWED[a] is every unit that a may import: exactly the arrows of "The map" in
# docs/architecture.md, derived from the imports the code has (every import counts:
# module level, inside a function, or under ``if TYPE_CHECKING:``: each is a
# dependency of the importing code, only loaded later). The arrows form a DAG.
ALLOWED: dict[str, frozenset[str]] = {
    "meshd": frozenset(),
    "logs": frozenset(),
    "domain": frozenset(),
    "crdt": frozenset(),
    "placement": frozenset({"crdt"}),
    "models": frozenset(),
    "transport": frozenset({"crdt"}),
    "engines": frozenset({"logs", "models", "transport"}),
    "node": frozenset({"meshd", "logs", "crdt", "placement", "models", "transport", "engines"}),
    "api": frozenset({"logs", "crdt", "placement", "models", "transport", "engines", "node"}),
    "cli": frozenset({"meshd", "logs", "crdt", "models", "transport", "node", "api"}),
}

# Units every unit may import, below all others: they import nothing of meshd (checked
# with the tables). meshd.domain holds the nouns every layer shares (a conversation, a
# request's sampling, a model's facts, a node's devices); types are moving into it, so
# its arrows are not listed one by one.
SHARED: frozenset[str] = frozenset({"domain"})

# The rules docs/architecture.md states in words; ALLOWED may never hold one of these
# arrows (checked on every run), and an import that takes one is reported with its rule.
FORBIDDEN: dict[tuple[str, str], str] = {
    ("node", "api"): "meshd.node never imports meshd.api (the API is served by the node)",
    ("engines", "crdt"): "meshd.engines never touches the CRDT",
    ("engines", "node"): "meshd.engines runs in runners, below the node",
    ("transport", "models"): "meshd.transport knows entries and frames, not models",
    ("transport", "engines"): "meshd.transport knows entries and frames, not models",
    ("crdt", "placement"): "meshd.crdt is the pure core: it imports no other part",
    ("placement", "models"): "meshd.placement is pure: it takes facts, it does not read them",
    ("placement", "transport"): "meshd.placement is pure: no I/O",
    ("placement", "node"): "meshd.placement is pure: it knows no daemon",
    ("models", "engines"): "meshd.models reads files and starts nothing",
    ("models", "node"): "meshd.models reads files and starts nothing",
}

# Imports that break a rule today, each named exactly ("file: module.name"). This list
# may only shrink: a new break fails, and an entry the code no longer has fails until it
# is removed. Both go away when the shared domain types (Device, the slice manifest) move
# out of crdt and models into a package both sides may import.
KNOWN_BREAKS: dict[str, str] = {
    # The weights transfer moves slices and checks them against their manifest (content
    # id, chunk digests), which lives in models.
    **{
        f"meshd/transport/{module}.py: meshd.models.manifest.{name}": "transport knows no models"
        for module, names in (
            ("transfer", ("Manifest", "verified_chunks", "write_manifest")),
            ("weights_pull", ("Manifest",)),
            ("weights_server", ("SLICE_FORMAT_VERSION", "Manifest")),
            (
                "weights_state",
                ("DIGEST_BYTES", "Manifest", "read_manifest", "verified_chunks", "write_manifest"),
            ),
        )
        for name in names
    },
}

# Where an arrow is allowed only into some modules of its target: the API reaches the
# node only through the types it is served with (the Services Protocol and what it
# returns), its errors, and the keep-alive marker of the request stream.
SURFACES: dict[tuple[str, str], frozenset[str]] = {
    ("api", "node"): frozenset(
        {
            "meshd.node.services",
            "meshd.node.member_views",
            "meshd.node.errors",
            "meshd.node.cluster",
            "meshd.node.metrics",
            "meshd.node.diagnosis_facts",
            "meshd.node.requests",
        }
    ),
}

# Modules a unit may not import at all (``x`` bans x and x.*; ``x*`` is a prefix, for
# functions such as os.exec*), nor reach as an attribute (``os.environ``) or a builtin.
_IO = (
    "asyncio", "socket", "ssl", "select", "selectors", "subprocess", "multiprocessing",
    "threading", "concurrent", "signal", "os", "io", "pathlib", "shutil", "tempfile",
    "mmap", "logging", "urllib", "http", "zmq", "zeroconf", "ifaddr", "httpx", "uvicorn",
    "starlette", "psutil", "builtins.open", "builtins.print", "builtins.input",
)  # fmt: skip
_CLOCKS_AND_RANDOMNESS = ("time", "datetime", "random", "secrets", "uuid")
_PROCESS_STARTERS = (
    "subprocess", "multiprocessing", "pty", "concurrent.futures.ProcessPoolExecutor",
    "concurrent.futures.process", "os.system", "os.popen", "os.fork*", "os.exec*",
    "os.spawn*", "os.posix_spawn*", "asyncio.create_subprocess_*",
)  # fmt: skip
_MODEL_LIBRARIES = ("gguf", "llama_cpp", "mlx", "mlx_lm", "tokenizers", "jinja2")
BANNED: dict[str, tuple[tuple[str, ...], str]] = {
    "domain": (_IO + _CLOCKS_AND_RANDOMNESS, "meshd.domain is plain Structs and pure functions"),
    # crdt reads the wall clock only as the default of its injectable clock (hlc.py).
    "crdt": (_IO, "meshd.crdt is pure: no I/O"),
    "placement": (_IO + _CLOCKS_AND_RANDOMNESS, "meshd.placement is pure: no I/O, clock, chance"),
    "models": (_PROCESS_STARTERS, "meshd.models reads files and starts no process"),
    "transport": (_MODEL_LIBRARIES, "meshd.transport knows entries and frames, not models"),
}

# ---------------------------------------------------------------------------------
# Sizes. A module over MODULE_LIMIT lines or a function (method, nested function: each
# counted from its ``def`` to its last line) over FUNCTION_LIMIT lines fails, unless it
# is listed below with its size today: a ratchet. A listed one may not grow past its
# entry; one back under the limit (or gone) must be removed from the list.
MODULE_LIMIT = 400
FUNCTION_LIMIT = 80

MODULE_SIZES: dict[str, int] = {
    "meshd/api/errors.py": 403,
    "meshd/api/responses_schemas.py": 478,
    "meshd/api/runs.py": 413,
    "meshd/api/schemas.py": 912,
    "meshd/cli/top.py": 704,
    "meshd/engines/llama_stage.py": 749,
    "meshd/engines/mlx_stage.py": 815,
    "meshd/models/folder.py": 490,
    "meshd/node/cluster.py": 481,
    "meshd/node/daemon.py": 568,
    "meshd/node/diagnosis.py": 637,
    "meshd/node/supervisor.py": 466,
    "meshd/placement/place.py": 1001,
    "meshd/transport/discovery.py": 410,
    "meshd/transport/gossip.py": 462,
    "meshd/transport/wire.py": 444,
}

# "file::qualified.name" (Class.method, outer.inner) -> lines.
FUNCTION_SIZES: dict[str, int] = {
    "meshd/cli/top.py::nodes_table": 86,
    "meshd/engines/llama_stage.py::LlamaStage.__init__": 104,
    "meshd/engines/mlx_stage.py::MlxStage.__init__": 81,
    "meshd/engines/mlx_stage.py::MlxStage._load_folder": 82,
    "meshd/models/convert.py::_gguf_tokenizer": 99,
    "meshd/models/convert.py::gguf_to_mlx_folder": 98,
    "meshd/models/folder.py::inspect_folder": 123,
    "meshd/node/daemon.py::_assemble": 147,
    "meshd/node/diagnosis.py::_bonjour": 86,
    "meshd/node/requests.py::Requests.generate": 82,
    "meshd/placement/place.py::_repair": 84,
    "meshd/placement/place.py::place": 123,
}

# TEMPORARY exemptions from the size check, for a module being split while the check
# runs: a file ("meshd/x/y.py") or a folder ("meshd/x/y/"), present or not (a missing
# one is no failure, so the split may land before or after its entry goes). Empty:
# meshd/engines/runner.py, exempt while it became the package meshd/engines/runner/,
# has landed and every module of that package is within the limits.
TEMPORARY_SIZE_EXEMPT: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    """One meshd import: ``target`` is the module it loads, ``names`` each name it takes."""

    path: str  # the importing file, relative to the root ("meshd/node/daemon.py")
    line: int
    module: str  # the importing module ("meshd.node.daemon")
    target: str  # the meshd module it reaches (the longest existing one)
    names: tuple[str, ...]  # "meshd.crdt.views.Device" for each name; the module if none
    kind: str  # "module", "function" (inside a def) or "type-checking"


@dataclass(frozen=True)
class External:
    """A name from outside meshd that a file uses: an import or a dotted attribute."""

    path: str
    line: int
    module: str
    name: str  # "os.environ", "subprocess", "builtins.open"


@dataclass
class Tree:
    root: Path
    modules: dict[str, str] = field(default_factory=dict)  # module -> relative path
    lines: dict[str, int] = field(default_factory=dict)  # relative path -> lines
    functions: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # key -> [(line, n)]
    imports: list[Import] = field(default_factory=list)
    externals: list[External] = field(default_factory=list)


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """The layering unit of a meshd module: its top-level package or module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def scan(root: Path, package: str = PACKAGE, deep: Iterable[str] = tuple(BANNED)) -> Tree:
    """Parse every module of ``package`` under ``root``. Attribute uses and builtin
    calls (``os.environ``, ``open()``) are read only in the units named by ``deep``:
    walking every expression of every module would double the run time for rules that
    only those units have."""
    tree = Tree(root=root)
    parsed: dict[str, tuple[str, ast.Module, bool]] = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        text = path.read_text(encoding="utf-8")
        mod = module_name(rel)
        tree.modules[mod] = rel.as_posix()
        tree.lines[rel.as_posix()] = len(text.splitlines())
        parsed[mod] = (
            rel.as_posix(),
            ast.parse(text, filename=str(rel)),
            rel.name == "__init__.py",
        )
    deep_units = set(deep)
    for mod, (where, node, is_pkg) in parsed.items():
        reader = _Reader(tree, where, mod, is_pkg, package)
        reader.statements(node.body, scope=(), kind="module")
        if unit_of(mod) in deep_units:
            reader.expressions(node)
    return tree


class _Reader:
    """Reads one module: its functions' sizes, its imports, and (on request) the
    dotted names it uses. Only statements are walked for the first two: imports and
    definitions are statements, and skipping expressions keeps the check fast."""

    def __init__(self, tree: Tree, path: str, module: str, is_pkg: bool, package: str) -> None:
        self.tree, self.path, self.module, self.package = tree, path, module, package
        self.here = module.split(".") if is_pkg else module.split(".")[:-1]
        self.aliases: dict[str, str] = {}  # local name -> dotted name outside meshd

    def statements(self, body: list[ast.stmt], scope: tuple[str, ...], kind: str) -> None:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = (*scope, stmt.name)
                key = f"{self.path}::{'.'.join(inner)}"
                size = (stmt.end_lineno or stmt.lineno) - stmt.lineno + 1
                self.tree.functions.setdefault(key, []).append((stmt.lineno, size))
                # Inside a def is "function" (deferred), even under TYPE_CHECKING.
                self.statements(stmt.body, inner, "function")
            elif isinstance(stmt, ast.ClassDef):
                self.statements(stmt.body, (*scope, stmt.name), kind)
            elif isinstance(stmt, ast.Import):
                self._import(stmt, kind)
            elif isinstance(stmt, ast.ImportFrom):
                self._import_from(stmt, kind)
            elif isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
                self.statements(stmt.body, scope, "type-checking" if kind == "module" else kind)
                self.statements(stmt.orelse, scope, kind)
            else:
                for name in ("body", "orelse", "finalbody"):
                    self.statements(getattr(stmt, name, []), scope, kind)
                for handler in getattr(stmt, "handlers", []):
                    self.statements(handler.body, scope, kind)
                for case in getattr(stmt, "cases", []):
                    self.statements(case.body, scope, kind)

    def expressions(self, module: ast.Module) -> None:
        """Every dotted name that starts at an import (``os.environ``), and the builtin
        calls ``open``, ``print``, ``input``."""
        for node in ast.walk(module):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                dotted = _dotted(node)
                if dotted is not None:
                    head, _, rest = dotted.partition(".")
                    if head in self.aliases:
                        self._external(node.lineno, f"{self.aliases[head]}.{rest}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("open", "print", "input")
                and node.func.id not in self.aliases
            ):
                self._external(node.lineno, f"builtins.{node.func.id}")

    def _resolve(self, dotted: str) -> str:
        """The longest existing meshd module that ``dotted`` names or lies inside."""
        parts = dotted.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in self.tree.modules:
                return candidate
            parts.pop()
        return dotted  # not in the tree: reported by the layering check

    def _meshd(self, node: ast.stmt, target: str, name: str, kind: str) -> None:
        self.tree.imports.append(Import(self.path, node.lineno, self.module, target, (name,), kind))

    def _external(self, line: int, name: str) -> None:
        self.tree.externals.append(External(self.path, line, self.module, name))

    def _import(self, node: ast.Import, kind: str) -> None:
        for alias in node.names:
            if alias.name == self.package or alias.name.startswith(self.package + "."):
                self._meshd(node, self._resolve(alias.name), alias.name, kind)
            else:
                self._external(node.lineno, alias.name)
                local = alias.asname or alias.name.split(".")[0]
                self.aliases[local] = alias.name if alias.asname else local

    def _import_from(self, node: ast.ImportFrom, kind: str) -> None:
        base = node.module or ""
        if node.level:
            up = self.here[: len(self.here) - node.level + 1]
            base = ".".join(up + ([base] if base else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if base == self.package or base.startswith(self.package + "."):
                target = full if full in self.tree.modules else self._resolve(base)
                self._meshd(node, target, full, kind)
            else:
                self._external(node.lineno, full)
                self.aliases[alias.asname or alias.name] = full


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


# ---------------------------------------------------------------------------------
def check_tables(
    allowed: Mapping[str, Iterable[str]],
    forbidden: Mapping[tuple[str, str], str],
    shared: Iterable[str] = SHARED,
) -> list[str]:
    """The tables themselves: ALLOWED holds no forbidden arrow and no cycle, and a
    shared unit imports nothing."""
    problems = [
        f"tools/structure.py: ALLOWED has {a} -> {b}, which a rule forbids: {why}"
        for (a, b), why in forbidden.items()
        if b in allowed.get(a, ())
    ]
    problems += [
        f"tools/structure.py: {s} is SHARED (anyone imports it), so it may import nothing"
        for s in sorted(shared)
        if set(allowed.get(s, ())) or s not in allowed
    ]
    graph = {a: set(bs) for a, bs in allowed.items()}
    for component in strongly_connected(graph):
        problems.append(
            f"tools/structure.py: ALLOWED has a cycle: {' -> '.join([*component, component[0]])}"
        )
    return problems


def check_layering(
    tree: Tree,
    allowed: Mapping[str, Iterable[str]] = ALLOWED,
    forbidden: Mapping[tuple[str, str], str] = FORBIDDEN,
    known_breaks: Mapping[str, str] = KNOWN_BREAKS,
    surfaces: Mapping[tuple[str, str], Iterable[str]] = SURFACES,
    banned: Mapping[str, tuple[tuple[str, ...], str]] = BANNED,
    shared: Iterable[str] = SHARED,
) -> list[str]:
    """Every meshd import follows an arrow, goes to a shared unit, or is a known break;
    no banned module."""
    shared = frozenset(shared)
    problems: list[str] = []
    used_arrows: set[tuple[str, str]] = set()
    used_breaks: set[str] = set()
    used_surface: set[str] = set()
    for unit in sorted({unit_of(m) for m in tree.modules} - set(allowed)):
        problems.append(
            f"{tree.modules.get(f'{PACKAGE}.{unit}', PACKAGE + '/' + unit)}:1: "
            f"{PACKAGE}.{unit} is in no layer: add it to ALLOWED in tools/structure.py "
            "and to the map in docs/architecture.md"
        )
    for imp in tree.imports:
        a, b = unit_of(imp.module), unit_of(imp.target)
        if a == b:
            continue
        where = f"{imp.path}:{imp.line}"
        breaks = [f"{imp.path}: {name}" for name in imp.names]
        if all(key in known_breaks for key in breaks):
            used_breaks.update(breaks)
            continue
        if imp.target not in tree.modules:
            problems.append(f"{where}: imports {imp.target}, which is not in the tree")
            continue
        if b in shared:
            continue
        if b not in allowed.get(a, ()):
            why = forbidden.get((a, b), "not an arrow of the map in docs/architecture.md")
            problems.append(
                f"{where}: {PACKAGE}.{a} may not import {PACKAGE}.{b} "
                f"({', '.join(imp.names)}): {why}"
            )
            continue
        used_arrows.add((a, b))
        surface = surfaces.get((a, b))
        if surface is not None:
            if imp.target in surface:
                used_surface.add(imp.target)
            else:
                problems.append(
                    f"{where}: {PACKAGE}.{a} reaches {PACKAGE}.{b} only through "
                    f"{', '.join(sorted(surface))}; not {imp.target}"
                )
    for key in sorted(set(known_breaks) - used_breaks):
        problems.append(f"tools/structure.py: KNOWN_BREAKS: {key} is gone: remove this entry")
    for a in sorted(allowed):
        for b in sorted(set(allowed[a]) - {x for (y, x) in used_arrows if y == a}):
            problems.append(
                f"tools/structure.py: ALLOWED: no import takes {a} -> {b} any more: remove "
                "the arrow here and from the map in docs/architecture.md"
            )
    for (a, b), surface in sorted(surfaces.items()):
        for module in sorted(set(surface) - used_surface):
            problems.append(
                f"tools/structure.py: SURFACES[{a}, {b}]: {module} is no longer imported: remove it"
            )
    for ext in tree.externals:
        rules = banned.get(unit_of(ext.module))
        if rules is None:
            continue
        patterns, why = rules
        for pattern in patterns:
            if _matches(ext.name, pattern):
                problems.append(f"{ext.path}:{ext.line}: uses {ext.name}: {why}")
                break
    return problems


def _matches(name: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return name == pattern or name.startswith(pattern + ".")


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node (or a node with an edge to itself),
    iteratively, each sorted; in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, todo = work[-1]
            if todo:
                w = todo.pop()
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, sorted(graph.get(w, ()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 or v in graph.get(v, ()):
                    found.append(sorted(component))
    return sorted(found)


def check_cycles(tree: Tree) -> list[str]:
    """No cycle between meshd modules.

    Every import counts, wherever it stands. A module-level cycle can fail at import
    time; one closed by an import inside a function or under ``if TYPE_CHECKING:`` runs,
    but only because that import was hidden from the interpreter: the two modules still
    need each other, which the layering forbids. Such edges are named in the report, so
    the fix is visible (move the shared thing down, or split the module).
    """
    edges: dict[str, dict[str, Import]] = {}
    for imp in tree.imports:
        if imp.target in tree.modules and imp.target != imp.module:
            edges.setdefault(imp.module, {}).setdefault(imp.target, imp)
    problems = []
    for component in strongly_connected({m: set(t) for m, t in edges.items()}):
        members = set(component)
        path = _cycle_through(component[0], edges, members)
        hops = []
        for a, b in itertools.pairwise(path):
            imp = edges[a][b]
            note = "" if imp.kind == "module" else f", {imp.kind} import"
            hops.append(f"{a} -> {b} ({imp.path}:{imp.line}{note})")
        first = edges[path[0]][path[1]]
        problems.append(f"{first.path}:{first.line}: import cycle: " + "; ".join(hops))
    return problems


def _cycle_through(
    start: str, edges: Mapping[str, Mapping[str, Import]], members: set[str]
) -> list[str]:
    """A shortest cycle from ``start`` back to it inside one component (breadth-first)."""
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, {})):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start, start]


def check_sizes(
    tree: Tree,
    module_limit: int = MODULE_LIMIT,
    function_limit: int = FUNCTION_LIMIT,
    module_sizes: Mapping[str, int] = MODULE_SIZES,
    function_sizes: Mapping[str, int] = FUNCTION_SIZES,
    exempt: Iterable[str] = TEMPORARY_SIZE_EXEMPT,
) -> tuple[list[str], list[str]]:
    """Problems, and notes (a listed one that shrank: its entry may be lowered)."""
    exempt = tuple(exempt)
    problems: list[str] = []
    notes: list[str] = []

    def is_exempt(path: str) -> bool:
        return any(path == e or (e.endswith("/") and path.startswith(e)) for e in exempt)

    def ratchet(where: str, what: str, size: int, limit: int, listed: int | None) -> None:
        if listed is None:
            if size > limit:
                problems.append(f"{where}: {what} is {size} lines (limit {limit}): split it")
        elif size > listed:
            problems.append(
                f"{where}: {what} grew to {size} lines; it may not pass its listed {listed} "
                f"(limit {limit}): split it"
            )
        elif size <= limit:
            problems.append(
                f"{where}: {what} is {size} lines, within the limit {limit}: remove its "
                "entry from tools/structure.py"
            )
        elif size < listed:
            notes.append(f"{where}: {what} shrank to {size} lines (listed {listed})")

    for path, lines in sorted(tree.lines.items()):
        if not is_exempt(path):
            ratchet(f"{path}:1", "module", lines, module_limit, module_sizes.get(path))
    for key, defs in sorted(tree.functions.items()):
        path, _, qualname = key.partition("::")
        if is_exempt(path):
            continue
        for line, size in defs:
            ratchet(f"{path}:{line}", qualname, size, function_limit, function_sizes.get(key))
    for path in sorted(set(module_sizes) - set(tree.lines)):
        problems.append(f"tools/structure.py: MODULE_SIZES: {path} is gone: remove this entry")
    for key in sorted(set(function_sizes) - set(tree.functions)):
        problems.append(f"tools/structure.py: FUNCTION_SIZES: {key} is gone: remove this entry")
    for path in sorted(set(module_sizes) | {k.partition("::")[0] for k in function_sizes}):
        if is_exempt(path):
            problems.append(f"tools/structure.py: {path} is both exempt and listed")
    return problems, notes


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    began = time.perf_counter()
    tree = scan(root)
    problems = check_tables(ALLOWED, FORBIDDEN)
    problems += check_layering(tree)
    problems += check_cycles(tree)
    size_problems, notes = check_sizes(tree)
    problems += size_problems
    for note in notes:
        print(f"note: {note}")
    for problem in problems:
        print(problem)
    deferred = sum(1 for imp in tree.imports if imp.kind != "module")
    took = time.perf_counter() - began
    if problems:
        print(
            f"structure: {len(problems)} problem(s) in layering, cycles or sizes "
            "(rules: tools/structure.py, docs/architecture.md 'The map')"
        )
        return 1
    print(
        f"structure: ok: {len(tree.modules)} modules, {len(tree.imports)} meshd imports "
        f"({deferred} in functions or TYPE_CHECKING), no cycle, sizes within limits "
        f"or the ratchet ({took:.2f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
