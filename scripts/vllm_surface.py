"""Read a vLLM release's API, as the gms plugin uses it, from its wheel (docs/vllm.md).

    python3 scripts/vllm_surface.py WHEEL [...] [--out tests/data/vllm_surface]

For every use in ``gms.integrations.vllm.surface.USES`` it records what the
release has there (found or not; a function's parameters, a class's abstract
methods, a constant's value), parsing the source with ``ast`` (nothing is
imported, so any release reads on any machine), and writes one JSON per
release, named by its version, and prints what the check finds.  The test
(``tests/test_vllm.py``) checks the kept JSONs without vLLM.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gms.integrations.vllm.surface import USES, check  # noqa: E402


class Source:
    """A release's Python files, read from its wheel."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.zip = zipfile.ZipFile(path)

    def read(self, relative: str) -> str | None:
        try:
            return self.zip.read(relative).decode()
        except KeyError:
            return None

    def module(self, dotted: str) -> ast.Module | None:
        base = dotted.replace(".", "/")
        for relative in (f"{base}.py", f"{base}/__init__.py"):
            text = self.read(relative)
            if text is not None:
                return ast.parse(text)
        return None

    def version(self) -> str:
        return self.path.name.split("-")[1]  # vllm-0.33.0-cp38-abi3-....whl


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[tuple[str, str, bool]]:
    a = fn.args
    out: list[tuple[str, str, bool]] = []
    positional = [(p, "positional") for p in a.posonlyargs] + [(p, "either") for p in a.args]
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    for (p, kind), has_default in zip(positional, defaults):
        out.append((p.arg, kind, has_default))
    if a.vararg:
        out.append((a.vararg.arg, "var_positional", True))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "keyword", d is not None))
    if a.kwarg:
        out.append((a.kwarg.arg, "var_keyword", True))
    if method and out and out[0][0] in ("self", "cls"):
        out = out[1:]
    return out


def _decorators(node) -> set[str]:
    return {getattr(d, "id", getattr(d, "attr", "")) for d in node.decorator_list}


def _class_fields(cls: ast.ClassDef) -> list[tuple[str, str, bool]]:
    return [(n.target.id, "keyword", n.value is not None) for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def find(source: Source, module: str, name: str, depth: int = 0) -> dict | None:
    tree = source.module(module)
    if tree is None:
        return None
    head, _, rest = name.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == head and not rest:
            return {"kind": "function", "params": params(node, False), "line": node.lineno}
        if isinstance(node, ast.ClassDef) and node.name == head:
            if not rest:
                init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
                abstract = sorted(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                                  and "abstractmethod" in _decorators(n))
                return {"kind": "class", "line": node.lineno, "abstract": abstract,
                        "params": params(init, True) if init else _class_fields(node)}
            for n in node.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == rest:
                    return {"kind": "method", "params": params(n, True), "line": n.lineno}
                if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == rest:
                    return {"kind": "field", "line": n.lineno}
            for base in node.bases:  # inherited: from a base named in this module
                if isinstance(base, ast.Name) and depth < 6:
                    found = find(source, module, f"{base.id}.{rest}", depth + 1)
                    if found:
                        return found
            return None
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and not rest:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == head for t in targets):
                value = node.value.value if isinstance(node.value, ast.Constant) else None
                return {"kind": "constant", "value": value, "line": node.lineno}
    # Re-exported: "from .x import name" or "from .x import *" (followed), or named in a lazy export table.
    if depth < 6:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            star = any(a.name == "*" for a in node.names)
            origin = next((a.name for a in node.names if (a.asname or a.name) == head), None)
            if origin is None and not star:
                continue
            target = node.module or ""
            if node.level:
                package = module if _is_package(source, module) else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                target = f"{package}.{target}" if target else package
            found = find(source, target, (origin or head) + (f".{rest}" if rest else ""), depth + 1)
            if found:
                return found
    if not rest and any(isinstance(n, ast.Constant) and n.value == head for n in ast.walk(tree)):
        return {"kind": "lazy"}
    return None


def _is_package(source: Source, module: str) -> bool:
    return source.read(module.replace(".", "/") + "/__init__.py") is not None


def surface(source: Source) -> dict:
    """What the check needs of each use (a "defined" class: that it is there)."""
    out = {}
    for use in USES:
        found = find(source, use.module, use.name)
        if found and use.kind in ("defined", "field", "subclass"):
            found = {k: v for k, v in found.items() if k in ("kind", "line", "abstract", "value")}
        out[use.key] = found
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sources", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("tests/data/vllm_surface"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for path in args.sources:
        source = Source(path)
        version = source.version()
        found = surface(source)
        (args.out / f"{version}.json").write_text(json.dumps(
            {"vllm": version, "source": path.name, "uses": found}, indent=1, sort_keys=True) + "\n")
        problems = check(found)
        bad += bool(problems)
        print(f"vllm {version}: " + ("ok" if not problems else "; ".join(problems)))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
