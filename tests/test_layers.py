"""The house is layered: no module of gms imports, however late (inside a
function too), a module that imports it back.  A package's ``__init__`` is
left out of its own submodules' edges: importing a submodule imports its
package first whatever it names, so that edge says nothing of the layering."""

from __future__ import annotations

import ast
from pathlib import Path

GMS = Path(__file__).resolve().parent.parent / "gms"


def modules() -> dict[str, Path]:
    found = {}
    for path in GMS.rglob("*.py"):
        parts = list(path.relative_to(GMS.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # a submodule named in "from x import y"
    return {m for m in out if m in known and m != name and not name.startswith(m + ".")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 100 and graph["gms.server.server"]  # the graph was read
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_loop_and_passes_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_keeper_imports_nothing_of_the_server_nor_of_the_core():
    """docs/architecture.md: the keeper holds fds and bytes it does not read; it
    imports the channel's frames and words, never the server, the pure core or
    the log (issue 64: it once reached into the server for two socket helpers)."""
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    reached, todo = set(), [n for n in known if n.startswith("gms.keeper")]
    while todo:
        name = todo.pop()
        for found in graph[name]:
            if found not in reached:
                reached.add(found)
                todo.append(found)
    assert not {n for n in reached if n.startswith(("gms.server", "gms.fsm", "gms.store"))}, sorted(
        n for n in reached if n.startswith(("gms.server", "gms.fsm", "gms.store")))


def test_routes_and_the_handshake_use_only_what_served_names_and_the_session_has_it():
    """Issue 64's typed seam, checked without a type checker: every ``s.<name>`` the route
    table and the handshake read is a member of ``Served``, none is assigned there, and
    the session has each (a class member, or set in its ``__init__``)."""
    from gms.server.service.served import Served
    from gms.server.service.session import Session

    members = set(Served.__annotations__) | {n for n in vars(Served) if not n.startswith("_")}
    service = GMS / "server" / "service"
    for name in ("routes.py", "handshake.py"):
        tree = ast.parse((service / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "s":
                assert node.attr in members, f"{name} uses s.{node.attr}, which Served does not name"
                assert not isinstance(node.ctx, ast.Store), f"{name} sets s.{node.attr} on the session"
    init = next(n for n in ast.walk(ast.parse((service / "session.py").read_text()))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)}
    missing = {m for m in members if not hasattr(Session, m) and m not in assigned}
    assert not missing, f"Served names what the session lacks: {sorted(missing)}"


def test_only_the_tiers_own_modules_name_a_particular_tier():
    """Tiers alike (issue 64): a tier by name only where tiers are the data (the fsm's
    state, rules, fold, releases, invariants, and its accounts by tier), in the one
    table that registers each store (the assembly), in the image's wire word, and where only the server reads its
    disk (the handshake).  A new module that asks ``tier is Tier.HOST`` belongs in
    one of these, or asks a layout (``evicted``, ``resident``, ``recovered``)."""
    import re

    named = re.compile(r"\b(?:MemoryTier|Tier)\.(?:GPU|HOST|DISK)\b")
    found = sorted(name for name, path in modules().items() if named.search(path.read_text()))
    assert found == [
        "gms.fsm.folding", "gms.fsm.invariants", "gms.fsm.releases", "gms.fsm.rules", "gms.fsm.state",
        "gms.fsm.tier_accounts", "gms.handover.image", "gms.server.assembly", "gms.server.service.handshake",
    ], found
