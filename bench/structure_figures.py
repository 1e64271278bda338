"""How the package is built, in figures a reader can recompute: the before / after of a
structural change (docs/architecture.md, "The structure in figures").

Static figures, read from the source with `ast` (nothing of the package is run):

- attention code paths per layer kind: the `torch.autograd.Function` classes whose backward
  computes a prefix attention (K/V: name with "Attention"; latent: "Latent" or "Mla"), the
  attention functions handed to transformers (`AttentionInterface.register`), and the call
  sites of the attention kernel dispatch (`dispatch.attention_kernel`,
  `dispatch.attention_backward_kernel`, `dispatch.flash_attn_partial`);
- places that compute rank coordinates: functions with `//` or `%` between a rank and a count
  of ranks (`rank // sequence_ranks`), or a rank list built as `d * size + s`;
- import circles: strongly connected sets of modules of `longstraw/` that import each other,
  imports inside functions included, a name taken from a package's `__init__` followed to the
  module that defines it (the layer test's own scan, `tests/layer_imports.py`); each circle says
  whether it lies inside one folder;
- lines of `ops/`, `engine/`, `distributed/` (every line of their .py files);
- whole-vs-sharded policy branches in `training/`: tests against None of a policy's sharded
  weights handle (`<x>.weights`) or of the rank group (`active_group()`), by function.

One dynamic figure (`--frames`): the Python frames of LongStraw's own files between the
`longstraw train` command and the call of the model in the first replayed branch (the first
model forward with autograd on), on a tiny run of one step in this process
(`longstraw train --no-prefect`, world size 1).

    .venv/bin/python bench/structure_figures.py --frames --out bench/results/structure.json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
import traceback
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The import scan is the layer test's own (tests/layer_imports.py), run from any directory.
sys.path.insert(0, str(REPO))
from tests.layer_imports import import_circles, package_modules  # noqa: E402

PACKAGE = REPO / "longstraw"

ATTENTION_DISPATCH = ("attention_kernel", "attention_backward_kernel", "flash_attn_partial")
RANK_COUNTS = ("sequence_ranks", "seq_size", "size", "world_size", "data_parallel")


def _folder(module: str, modules: dict[str, Path]) -> str:
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def circle_figures() -> dict:
    modules = package_modules(PACKAGE)
    found = import_circles(PACKAGE)
    return {
        "count": len(found),
        "inside_one_folder": sum(len({_folder(m, modules) for m in c}) == 1 for c in found),
        "circles": found,
    }


def _functions(tree: ast.AST):
    """(qualified name, node) of every function, methods as Class.method."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{prefix}{child.name}", child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _own_nodes(function: ast.AST) -> list[ast.AST]:
    """The nodes of `function`'s body, less those of the functions nested in it (which are
    counted on their own)."""
    body = [n for stmt in function.body for n in ast.walk(stmt)]
    nested = {
        id(n)
        for inner in ast.walk(function)
        if inner is not function and isinstance(inner, (ast.FunctionDef, ast.Lambda))
        for n in ast.walk(inner)
    }
    return [n for n in body if id(n) not in nested]


def _mentions(node: ast.AST, words: tuple[str, ...]) -> bool:
    text = ast.unparse(node)
    return any(w in text for w in words)


def _rank_arithmetic(node: ast.AST) -> bool:
    if not isinstance(node, ast.BinOp):
        return False
    if isinstance(node.op, (ast.FloorDiv, ast.Mod)):
        return _mentions(node.left, ("rank",)) and _mentions(node.right, RANK_COUNTS)
    # A global rank from a replica and a sequence index: d * size + s.
    if isinstance(node.op, ast.Add) and isinstance(node.left, ast.BinOp):
        inner = node.left
        return isinstance(inner.op, ast.Mult) and _mentions(inner, RANK_COUNTS)
    return False


def rank_coordinate_figures() -> dict:
    places: dict[str, list[str]] = defaultdict(list)
    for path in package_modules(PACKAGE).values():
        tree = ast.parse(path.read_text())
        for qualname, function in _functions(tree):
            if any(_rank_arithmetic(n) for n in _own_nodes(function)):
                places[str(path.relative_to(REPO))].append(qualname)
    return {
        "files": len(places),
        "functions": sum(len(v) for v in places.values()),
        "places": dict(sorted(places.items())),
    }


def _bases(node: ast.ClassDef) -> list[str]:
    return [ast.unparse(b) for b in node.bases]


def attention_figures() -> dict:
    kinds: dict[str, list[str]] = {"kv": [], "latent": []}
    registered: list[str] = []
    dispatch_sites: dict[str, list[str]] = defaultdict(list)
    for path in package_modules(PACKAGE).values():
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(REPO))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                b.endswith("autograd.Function") for b in _bases(node)
            ):
                has_backward = any(
                    isinstance(n, ast.FunctionDef) and n.name == "backward" for n in node.body
                )
                if not has_backward:
                    continue
                if "Latent" in node.name or "Mla" in node.name:
                    kinds["latent"].append(f"{where}:{node.name}")
                elif "Attention" in node.name:
                    kinds["kv"].append(f"{where}:{node.name}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                called = ast.unparse(node.func)
                if called.endswith("AttentionInterface.register"):
                    registered.append(f"{where}:{ast.unparse(node.args[1])}")
                if node.func.attr in ATTENTION_DISPATCH and "dispatch" in called:
                    dispatch_sites[node.func.attr].append(f"{where}:{node.lineno}")
    return {
        "autograd_functions_per_kind": {k: len(v) for k, v in kinds.items()},
        "autograd_functions": kinds,
        "functions_handed_to_transformers": registered,
        "attention_dispatch_sites": {k: sorted(v) for k, v in sorted(dispatch_sites.items())},
    }


def _policy_placement_test(node: ast.AST) -> bool:
    """`<x>.weights is (not) None` or `active_group() is (not) None`."""
    if not isinstance(node, ast.Compare) or not isinstance(node.ops[0], (ast.Is, ast.IsNot)):
        return False
    if not (isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None):
        return False
    left = node.left
    if isinstance(left, ast.Attribute):
        return left.attr == "weights"
    return isinstance(left, ast.Call) and ast.unparse(left.func) == "active_group"


def policy_branch_figures(package: Path = PACKAGE) -> dict:
    places: dict[str, list[str]] = defaultdict(list)
    for path in sorted((package / "training").rglob("*.py")):
        for qualname, function in _functions(ast.parse(path.read_text())):
            found = [n for n in _own_nodes(function) if _policy_placement_test(n)]
            places[str(path.relative_to(package.parent))] += [qualname] * len(found)
    places = {k: v for k, v in sorted(places.items()) if v}
    return {"count": sum(len(v) for v in places.values()), "places": places}


def line_figures() -> dict:
    counts = {
        folder: sum(len(p.read_text().splitlines()) for p in (PACKAGE / folder).rglob("*.py"))
        for folder in ("ops", "engine", "distributed")
    }
    return {**counts, "total": sum(counts.values())}


def frames_to_replayed_branch() -> dict:
    """Frames between the `longstraw train` command and the model call of the first replayed
    branch, on a one-step tiny run in this process."""
    import torch
    import yaml
    from transformers import PreTrainedModel

    from longstraw import cli

    captured: list[traceback.StackSummary] = []

    def on_forward(module, args, kwargs):
        if captured or not torch.is_grad_enabled() or not isinstance(module, PreTrainedModel):
            return
        captured.append(traceback.extract_stack())

    config = {
        "run_id": "frames",
        "model": {"init_family": "qwen3_5", "init_size": "tiny", "dtype": "float32"},
        "engine": {"shard_tokens": 64, "prompt_grad": "exact"},
        "grpo": {"num_generations": 2, "max_completion_length": 2, "loss_type": "dapo"},
        "data": {
            "type": "haystack",
            "num_prompts": 1,
            "rewards": ["haystack_shaped"],
            "task": {"num_prompt_tokens": 150},
        },
        "train": {"num_steps": 1, "groups_per_step": 1, "checkpoint_every": 100},
    }
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: on_forward(module, args, None)
    )
    try:
        with tempfile.TemporaryDirectory(prefix="longstraw-frames-") as tmp:
            config["storage"] = {"root_uri": tmp}
            path = Path(tmp) / "run.yaml"
            path.write_text(yaml.safe_dump(config))
            try:
                cli.app(["train", "--config", str(path), "--no-prefect"], standalone_mode=False)
            except SystemExit as exit_:
                if exit_.code:
                    raise
    finally:
        hook.remove()
    assert captured, "no model forward ran with autograd on: nothing was replayed"
    stack = list(captured[0])
    start = next(i for i, f in enumerate(stack) if f.name == "train_command")
    # Up to the frame that calls the model (torch.nn.Module's own frames excluded).
    end = max(i for i, f in enumerate(stack) if str(PACKAGE) in f.filename)
    frames = stack[start : end + 1]
    own = [f for f in frames if str(PACKAGE) in f.filename]
    return {
        "longstraw_frames": len(own),
        "all_frames": len(frames),
        "path": [f"{Path(f.filename).relative_to(REPO)}:{f.name}" for f in own],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", action="store_true", help="also run a tiny step (≈ 1 min)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--verbose", action="store_true", help="print every place found")
    args = parser.parse_args()
    figures = {
        "attention": attention_figures(),
        "rank_coordinates": rank_coordinate_figures(),
        "import_circles": circle_figures(),
        "lines": line_figures(),
        "policy_branches": policy_branch_figures(),
    }
    if args.frames:
        figures["frames"] = frames_to_replayed_branch()
    summary = {
        "attention autograd functions per kind": figures["attention"][
            "autograd_functions_per_kind"
        ],
        "attention functions handed to transformers": len(
            figures["attention"]["functions_handed_to_transformers"]
        ),
        "attention dispatch sites": {
            k: len(v) for k, v in figures["attention"]["attention_dispatch_sites"].items()
        },
        "files / functions computing rank coordinates": (
            figures["rank_coordinates"]["files"],
            figures["rank_coordinates"]["functions"],
        ),
        "import circles (inside one folder)": (
            figures["import_circles"]["count"],
            figures["import_circles"]["inside_one_folder"],
        ),
        "lines ops + engine + distributed": figures["lines"],
        "whole-vs-sharded policy branches in training/": figures["policy_branches"]["places"],
    }
    if args.frames:
        summary["frames longstraw train -> replayed branch's model call"] = figures["frames"][
            "longstraw_frames"
        ]
    print(json.dumps(figures if args.verbose else summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
