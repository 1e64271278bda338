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


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(check([tuple(layer) for layer in spec["layers"]])))
