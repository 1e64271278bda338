"""Session-wide fixtures: real tiny HF checkpoints built once per test session.

Every test that needs a model loads it from a checkpoint directory written by `init_model`, so it
goes through the same `from_pretrained` path a user's checkpoint takes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis_profiles import register_and_load_profiles

# Tests run on 2 cores; more threads only add contention. Under pytest-xdist the workers share
# the cores: each gets its share of them (one thread each on 2 cores with `-n 2`), because
# OpenMP threads that outnumber the cores spin-wait on each other and slow every test down.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Property tests draw the same examples on every run of a commit (`default`, and `ci` under
# CI=true); HYPOTHESIS_PROFILE=search is the opt-in wide random search (tests/hypothesis_profiles.py).
register_and_load_profiles()

ENGINE_FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_next")
SEED = 42


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory) -> Callable[..., Path]:
    """`checkpoint_dir(family, size="tiny")` -> a checkpoint directory, built on first use."""
    from longstraw.models.factory import init_model

    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, size: str = "tiny") -> Path:
        key = (family, size)
        if key not in built:
            built[key] = init_model(family, size, root / f"{family}-{size}", seed=SEED)
        return built[key]

    return get


@pytest.fixture(scope="session")
def load_tiny(checkpoint_dir) -> Callable[..., torch.nn.Module]:
    """`load_tiny(family, dtype=torch.float32)` -> a fresh model loaded from its checkpoint."""
    from longstraw.models.checkpoint import load_checkpoint

    def load(family: str, dtype: torch.dtype = torch.float32, size: str = "tiny"):
        model, _, _ = load_checkpoint(checkpoint_dir(family, size), dtype=dtype)
        model.eval()  # dropout-free either way; eval() documents that no train-mode path is used
        return model

    return load


@pytest.fixture(scope="session")
def load_tokenizer(checkpoint_dir) -> Callable[..., object]:
    """`load_tokenizer(family)` -> the checkpoint's tokenizer as AutoTokenizer loads it."""
    from transformers import AutoTokenizer

    def load(family: str, size: str = "tiny"):
        return AutoTokenizer.from_pretrained(str(checkpoint_dir(family, size)))

    return load


@pytest.fixture(scope="session")
def migrated_prefect_db(tmp_path_factory) -> Path:
    """An empty Prefect SQLite database with every migration applied, made once per session
    (`prefect server database upgrade`, in a subprocess: this process's Prefect settings stay
    untouched). A Prefect server started on an empty home spends about 12 s of its start (2 cores)
    creating and migrating its database; servers started by the tests get a copy of this one.
    """
    import subprocess
    import sys

    home = tmp_path_factory.mktemp("prefect-db-template")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("prefect")), "server", "database", "upgrade", "-y"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (home / "prefect.db").is_file(), sorted(p.name for p in home.iterdir())
    return home / "prefect.db"


@pytest.fixture(scope="session")
def fresh_prefect_home(migrated_prefect_db) -> Callable[[Path], Path]:
    """`fresh_prefect_home(path)` -> a new PREFECT_HOME at `path` holding its own copy of the
    migrated database, for a subprocess that starts a Prefect server (`longstraw train`'s
    ephemeral API, `prefect server start`). No two tests share flow runs or a database file."""
    import shutil

    def make(home: Path) -> Path:
        home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(migrated_prefect_db, home / "prefect.db")
        return home

    return make


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "processes: starts other processes (ranks, a `longstraw` CLI or a Python child, a server)",
    )
    if "not processes" in (config.option.markexpr or ""):
        _refuse_unmarked_processes()


_running: list[pytest.Item] = []
"""The test being run (its set-up, call and tear-down, fixtures of any scope included)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _running.append(item)
    yield
    _running.pop()


def _refuse_unmarked_processes() -> None:
    """In a run that leaves out the `processes` tests (`make test-fast`), a test that starts a
    process anyway — in its body or in a fixture of any scope — fails at once and names the
    marker it lacks: the fast subset stays what it says it is."""
    import multiprocessing.process
    import subprocess

    def check() -> None:
        if _running and not _running[-1].get_closest_marker("processes"):
            raise AssertionError(
                f"{_running[-1].nodeid} starts a process: mark it @pytest.mark.processes "
                "(tests/README.md)"
            )

    execute_child = subprocess.Popen._execute_child
    start = multiprocessing.process.BaseProcess.start

    def checked_execute_child(self, *args, **kwargs):
        check()
        return execute_child(self, *args, **kwargs)

    def checked_start(self):
        check()
        return start(self)

    subprocess.Popen._execute_child = checked_execute_child
    multiprocessing.process.BaseProcess.start = checked_start
