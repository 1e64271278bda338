"""Import LongStraw's layers bottom to top, each refusing every layer at or above its level.

Run in a fresh interpreter by tests/test_layers.py:

    python tests/layer_imports.py '<json>'

where the JSON is `{"layers": [[package, level, [module, ...]], ...]}` (layers in import order,
bottom first; `package` is the layer's dotted name, e.g. "longstraw.engine"). Prints one JSON
line: `{package: {"forbidden": [...], "error": str | null}}`.

A meta-path finder refuses a forbidden module that is imported for the first time. A forbidden
module that is already imported (a sibling at the same level, imported earlier) would never reach
a finder, so while a layer imports, the forbidden modules are taken out of `sys.modules` and off
their parent package, and put back afterwards: an import of them then reaches the finder too.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
from importlib.abc import MetaPathFinder
from pathlib import Path


class RefusedImport(ImportError):
    """A layer imported a module of a layer at or above its own level."""


class RefuseLayers(MetaPathFinder):
    """Refuses every module under one of the `forbidden` dotted prefixes."""

    def __init__(self) -> None:
        self.forbidden: tuple[str, ...] = ()

    def find_spec(self, fullname, path, target=None):
        for prefix in self.forbidden:
            if fullname == prefix or fullname.startswith(prefix + "."):
                raise RefusedImport(f"{fullname} is forbidden here (layer {prefix})")
        return None


def _hide(prefixes: tuple[str, ...]) -> dict[str, object]:
    """Take the modules under `prefixes` out of sys.modules and off their parents."""
    hidden = {
        name: module
        for name, module in sys.modules.items()
        if any(name == p or name.startswith(p + ".") for p in prefixes)
    }
    for name in hidden:
        del sys.modules[name]
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], child):
            delattr(sys.modules[parent], child)
    return hidden


def _restore(hidden: dict[str, object]) -> None:
    for name, module in hidden.items():
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def check(layers: list[tuple[str, int, list[str]]]) -> dict[str, dict]:
    finder = RefuseLayers()
    sys.meta_path.insert(0, finder)
    report: dict[str, dict] = {}
    for package, level, modules in layers:
        forbidden = tuple(
            sorted(
                other
                for other, other_level, _ in layers
                if other_level >= level and other != package
            )
        )
        finder.forbidden = forbidden
        hidden = _hide(forbidden)
        error = None
        try:
            for module in modules:
                try:
                    importlib.import_module(module)
                except ImportError as err:
                    error = f"importing {module}: {type(err).__name__}: {err}"
                    break
        finally:
            finder.forbidden = ()
            _restore(hidden)
        report[package] = {"forbidden": list(forbidden), "error": error}
    return report


def upward_imports(package_dir: Path, levels: dict[str, int]) -> list[str]:
    """Every `import longstraw.X` / `from longstraw.X import` in the package's source, at any
    depth (inside functions too), whose layer X is at or above the importing module's level."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[0] == "__init__" or parts[0] not in levels:
            continue
        module = ".".join(("longstraw", *parts)).removesuffix(".__init__")
        own = parts[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif (
                isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "longstraw"
            ):
                targets = [f"longstraw.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                pieces = target.split(".")
                if pieces[0] != "longstraw" or len(pieces) < 2 or pieces[1] == own:
                    continue
                other = pieces[1]
                if other in levels and levels[other] >= levels[own]:
                    found.append(
                        f"{module} ({own}, level {levels[own]}) imports longstraw.{other} "
                        f"({other}, level {levels[other]})"
                    )
    return found


def package_modules(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package in `package_dir` (its folder's name
    is the package's)."""
    root = package_dir.parent
    return {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(package_dir.rglob("*.py"))
    }


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules.get(name, Path()).name == "__init__.py"


def _reexports(init: Path, package: str, modules: dict[str, Path]) -> dict[str, str]:
    """Names a package's `__init__` takes from its own modules: name -> defining module."""
    out = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module in modules
            and node.module.startswith(package + ".")
        ):
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth of its source (inside functions
    too); a name taken from a package's `__init__` counts as an import of the module that
    defines it."""
    modules, package = package_modules(package_dir), package_dir.name
    exports = {
        name: _reexports(path, name, modules)
        for name, path in modules.items()
        if path.name == "__init__.py"
    }
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        targets.append(full)
                    elif _is_package(base, modules) and alias.name in exports.get(base, {}):
                        targets.append(exports[base][alias.name])
                    else:
                        targets.append(base)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.split(".")[0] == package:
                    graph[name].add(target)
    return graph


def import_circles(package_dir: Path) -> list[list[str]]:
    """The package's modules that import each other in a circle, inside one folder or across
    folders: strongly connected components of more than one module (Tarjan, iterative)."""
    graph = import_graph(package_dir)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
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
    return sorted(found)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(check([tuple(layer) for layer in spec["layers"]])))
