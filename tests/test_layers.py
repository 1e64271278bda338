"""The package map holds: each layer imports with every layer at or above its level refused.

`LEVELS` is the map of docs/architecture.md (a layer may import only layers at lower levels).
The import test runs in one fresh interpreter (tests/layer_imports.py); deliberate violations in
a throwaway package check that the refusal works, for a first import and for an already
imported module. A static scan covers the imports inside functions, which importing a module
does not execute, and finds modules that import each other in a circle — inside one folder too,
where the layer map cannot see them.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import longstraw
from tests.layer_imports import import_circles, upward_imports

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(longstraw.__file__).parent

# Level of each top-level package or module of longstraw; bottom first.
LEVELS = {
    "errors": 0,
    "console": 0,
    "schemas": 1,
    "ops": 2,
    "models": 3,
    "grpo": 4,
    "engine": 5,
    "data": 6,
    "storage": 6,
    "distributed": 7,
    "trackers": 7,
    "training": 8,
    "audit": 9,
    "tasks": 10,
    "flows": 11,
    "train_entry": 12,
    "eval_entry": 12,
    "cli": 13,
}


def _entries() -> list[str]:
    """The top-level packages and modules of longstraw (not its __init__)."""
    return sorted(
        m.name for m in pkgutil.iter_modules([str(PACKAGE)]) if not m.name.startswith("_")
    )


def _modules(entry: str) -> list[str]:
    path = PACKAGE / entry
    if not path.is_dir():
        return [f"longstraw.{entry}"]
    walked = pkgutil.walk_packages([str(path)], f"longstraw.{entry}.")
    # __main__ modules run their command when imported.
    names = [m.name for m in walked if not m.name.endswith(".__main__")]
    return [f"longstraw.{entry}", *sorted(names)]


def _probe_package(root: Path) -> Path:
    """A throwaway package whose modules import layers they must not."""
    probe = root / "layerprobe"
    probe.mkdir()
    (probe / "__init__.py").write_text("")
    # Imported before any engine module exists in the interpreter.
    (probe / "fresh.py").write_text("import longstraw.engine.state\n")
    # Imported at the data/storage level after every layer: cached in sys.modules, and an
    # attribute of the parent package.
    (probe / "cached_module.py").write_text("import longstraw.storage.cache\n")
    (probe / "cached_attribute.py").write_text("from longstraw import training\n")
    return root


@pytest.fixture(scope="module")
def layer_report(tmp_path_factory) -> dict[str, dict]:
    layers = [[f"longstraw.{e}", LEVELS[e], _modules(e)] for e in _entries() if e in LEVELS]
    layers.sort(key=lambda layer: layer[1])
    schemas_at = next(i for i, layer in enumerate(layers) if layer[0] == "longstraw.schemas")
    layers.insert(schemas_at + 1, ["layerprobe.fresh", LEVELS["schemas"], ["layerprobe.fresh"]])
    for name in ("cached_module", "cached_attribute"):
        layers.append([f"layerprobe.{name}", LEVELS["storage"], [f"layerprobe.{name}"]])
    root = _probe_package(tmp_path_factory.mktemp("probe"))
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "layer_imports.py"), json.dumps({"layers": layers})],
        cwd=REPO,
        env={"PYTHONPATH": f"{REPO}:{root}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_package_is_in_the_layer_map():
    unmapped = [e for e in _entries() if e not in LEVELS]
    assert not unmapped, f"add {unmapped} to LEVELS and to docs/architecture.md's package map"


@pytest.mark.processes
def test_each_layer_imports_with_the_layers_above_it_refused(layer_report):
    real = {f"longstraw.{e}" for e in _entries()}
    top = max(LEVELS[e] for e in _entries())
    checked = [p for p in layer_report if p in real]
    assert sorted(checked) == sorted(real)
    for package in checked:
        forbidden = set(layer_report[package]["forbidden"]) & real
        if LEVELS[package.split(".")[1]] < top:
            assert forbidden, f"{package}: no layer refused, the check would pass vacuously"
        assert layer_report[package]["error"] is None, (package, layer_report[package])


@pytest.mark.processes
def test_a_deliberate_violation_is_refused(layer_report):
    fresh = layer_report["layerprobe.fresh"]
    assert "longstraw.engine" in fresh["forbidden"]
    assert "RefusedImport" in fresh["error"] and "longstraw.engine" in fresh["error"]
    cached = layer_report["layerprobe.cached_module"]
    assert "RefusedImport" in cached["error"] and "longstraw.storage" in cached["error"]
    attribute = layer_report["layerprobe.cached_attribute"]
    assert "RefusedImport" in attribute["error"] and "longstraw.training" in attribute["error"]


def test_no_module_imports_a_layer_above_it_even_inside_a_function():
    found = upward_imports(PACKAGE, LEVELS)
    assert not found, "\n".join(found)


def test_the_static_scan_finds_an_import_inside_a_function(tmp_path):
    fake = tmp_path / "longstraw"
    (fake / "ops").mkdir(parents=True)
    (fake / "ops" / "__init__.py").write_text("")
    (fake / "ops" / "kernel.py").write_text(
        textwrap.dedent(
            """
            from longstraw.schemas import grpo

            def late():
                from longstraw.engine import state
                import longstraw.ops.other
            """
        )
    )
    assert upward_imports(fake, LEVELS) == [
        "longstraw.ops.kernel (ops, level 2) imports longstraw.engine (engine, level 5)"
    ]


def test_the_documented_map_is_this_one():
    order: dict[int, list[str]] = {}
    for entry, level in LEVELS.items():
        if (PACKAGE / entry).exists() or (PACKAGE / f"{entry}.py").exists():
            order.setdefault(level, []).append(f"`{entry}`")
    line = " < ".join(" / ".join(sorted(names)) for _, names in sorted(order.items()))
    architecture = (REPO / "docs" / "architecture.md").read_text()
    assert line in architecture, f"docs/architecture.md should list the layers as: {line}"


KNOWN_CIRCLES: list[list[str]] = []
"""Circles the package still has, each with what removes it; the list only shrinks."""


def test_no_modules_import_each_other_in_a_circle():
    found = import_circles(PACKAGE)
    new = [circle for circle in found if circle not in KNOWN_CIRCLES]
    assert not new, "modules that import each other (inside functions too): " + "; ".join(
        " <-> ".join(circle) for circle in new
    )
    gone = [circle for circle in KNOWN_CIRCLES if circle not in found]
    assert not gone, f"{gone} no longer import each other: take them off KNOWN_CIRCLES"


def test_the_circle_scan_finds_a_circle_inside_a_folder_through_a_late_import(tmp_path):
    fake = tmp_path / "pkg"
    (fake / "engine").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "engine" / "__init__.py").write_text("from pkg.engine.group import run\n")
    (fake / "engine" / "group.py").write_text(
        "from pkg.engine.seam import LOCAL\n\ndef run(): ...\n"
    )
    (fake / "engine" / "seam.py").write_text(
        textwrap.dedent(
            """
            LOCAL = None

            def sink():
                from pkg.engine import run  # through the package's __init__
            """
        )
    )
    (fake / "engine" / "apart.py").write_text("import pkg.engine.seam\n")
    assert import_circles(fake) == [["pkg.engine.group", "pkg.engine.seam"]]
