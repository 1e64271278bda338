"""Download the wheels the GPU machine's image lacks (bench/gpu_wheels.txt) into bench/gpu_wheels/,
and check that they travel with the tree: run here, where pip reaches a registry.

    make gpu-wheels            # or: python3 bench/gpu_wheels.py

The GPU machine runs Python 3.12 on x86_64 and reaches no registry: the wheels are fetched for
that interpreter and platform whatever this machine is, with the hashes the list pins. They go
into a fresh folder (no other version left beside them), which git ignores; the device call
names it in `carry`. The tree that travels (tracked and untracked-not-ignored files, plus the
carried folder) must stay under `TRAVEL_CAP_BYTES`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "bench" / "gpu_wheels.txt"
WHEELS = ROOT / "bench" / "gpu_wheels"

TRAVEL_CAP_BYTES = 64 * 2**20
"""What a device call may send: the working tree and its carried paths together."""
WHEELS_CAP_BYTES = 24 * 2**20
"""The carried wheels' share (15.6 MiB now, transformers 12.9 of it): the rest, 40 MiB, is the
tree's."""

# The GPU image's interpreter: CPython 3.12, manylinux x86_64 (pip matches each tag exactly).
_TARGET = [
    "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64",
]  # fmt: skip
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)", re.MULTILINE)


def pinned(text: str) -> dict[str, str]:
    """{distribution: version} of every `name==version` line of a requirements text."""
    return {name.lower(): version for name, version in _PIN.findall(text)}


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends of `root` without carry: git's tracked files and the
    untracked files it does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = [root / p for p in listed.decode().split("\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def download(folder: Path = WHEELS) -> list[Path]:
    """The pinned wheels, hash-checked, in `folder` (replaced whole)."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         *_TARGET, "--require-hashes", "-r", str(REQUIREMENTS), "-d", str(partial)],
        check=True,
    )  # fmt: skip
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return sorted(folder.glob("*.whl"))


def main() -> int:
    wheels = download()
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes()
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"wheels {wheel_bytes / 2**20:.1f} MiB, tree {tree / 2**20:.1f} MiB, together "
          f"{(wheel_bytes + tree) / 2**20:.1f} of {TRAVEL_CAP_BYTES / 2**20:.0f} MiB")  # fmt: skip
    if wheel_bytes > WHEELS_CAP_BYTES or wheel_bytes + tree > TRAVEL_CAP_BYTES:
        print(
            f"gpu_wheels: over the cap (wheels {WHEELS_CAP_BYTES / 2**20:.0f} MiB, "
            f"all {TRAVEL_CAP_BYTES / 2**20:.0f} MiB): carry less",
            file=sys.stderr,
        )
        return 1
    print(f'carry: ["{WHEELS.relative_to(ROOT)}"]')
    return 0


if __name__ == "__main__":
    sys.exit(main())
