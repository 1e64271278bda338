"""A private PREFECT_HOME for task tests (set before prefect is imported; tests/flows/conftest.py
sets the same variables when both folders run in one session)."""

from __future__ import annotations

import os
import tempfile

if "LONGSTRAW_TEST_PREFECT_HOME" not in os.environ:
    home = tempfile.mkdtemp(prefix="longstraw-prefect-")
    os.environ["LONGSTRAW_TEST_PREFECT_HOME"] = home
    os.environ["PREFECT_HOME"] = home
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = os.path.join(home, "results")
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ.pop("PREFECT_API_URL", None)
