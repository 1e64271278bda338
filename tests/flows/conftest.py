"""Prefect fixtures: a private PREFECT_HOME, ONE test harness per session, shared tiny runs.

Prefect reads its settings when it is first imported, so the environment is set here, at import
of this conftest (before any test module imports prefect), and again as temporary settings in
the harness. `prefect_test_harness` is slow to start (a server process): it is started once per session, and
only when a test asks for it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest

from longstraw.train_entry import configure_prefect_logging

# One private Prefect home for the whole session (results, locks, the harness's settings); a
# user's configured server (PREFECT_API_URL) must never receive test runs.
PREFECT_TEST_HOME = Path(tempfile.mkdtemp(prefix="longstraw-prefect-"))
os.environ["LONGSTRAW_TEST_PREFECT_HOME"] = str(PREFECT_TEST_HOME)
os.environ["PREFECT_HOME"] = str(PREFECT_TEST_HOME)
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(PREFECT_TEST_HOME / "results")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
# The console and API log levels `longstraw train` uses: its flows' INFO lines reach the API.
os.environ.pop("PREFECT_LOGGING_LEVEL", None)
configure_prefect_logging(os.environ)
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("PREFECT_PROFILES_PATH", None)


@pytest.fixture(scope="session")
def prefect_harness(migrated_prefect_db):
    """A temporary Prefect API (SQLite in a temp dir) for every flow of the session.

    The harness creates its database as `prefect-test.db` in a directory of its own (`mkdtemp`);
    it is handed a directory that already holds a copy of the session's migrated database, so its
    server starts without creating and migrating one.
    """
    import prefect.testing.utilities as harness_module
    from prefect.settings import (
        PREFECT_HOME,
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )

    settings = {
        PREFECT_HOME: PREFECT_TEST_HOME,
        PREFECT_LOCAL_STORAGE_PATH: PREFECT_TEST_HOME / "results",
        PREFECT_SERVER_ANALYTICS_ENABLED: False,
    }
    db_dir = Path(tempfile.mkdtemp(prefix="longstraw-harness-db-"))
    shutil.copyfile(migrated_prefect_db, db_dir / "prefect-test.db")
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_settings(updates=settings))
        # mock.patch.object refuses a missing attribute: a Prefect that no longer calls
        # `mkdtemp` there fails here instead of silently migrating a database of its own.
        with mock.patch.object(harness_module, "mkdtemp", lambda: str(db_dir)):
            # 120 s: a first start on a loaded 2-core machine can exceed the default 30 s.
            stack.enter_context(harness_module.prefect_test_harness(server_startup_timeout=120))
        from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

        assert str(db_dir) in PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
        yield


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    """Storage root shared by the session's tiny runs (the initial checkpoint is built once;
    each run has its own run_id and so its own key space)."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def in_process_digest(runs_root) -> str:
    """Final weights digest of the tiny 2-step run by the pure in-process loop (no Prefect)."""
    from flow_helpers import final_weights_digest, tiny_run_config

    from longstraw.training.loop import train

    config = tiny_run_config(runs_root, "in-process", num_steps=2)
    ctx = train(config)
    assert [m.step for m in ctx.history] == [0, 1]
    assert all(m.grad_norm > 0 for m in ctx.history), "zero gradient: digests could not differ"
    return final_weights_digest(config)
