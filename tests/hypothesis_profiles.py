"""Hypothesis settings profiles: every property test is reproducible unless a search is asked for.

- `default` (a developer's `make test`) and `ci` (loaded when `CI=true`): derandomized, no example
  database, so the same commit draws the same examples on every run and machine; each test keeps
  its own `max_examples`. `ci` also prints the reproduction blob of a failure.
- `search` (`HYPOTHESIS_PROFILE=search make test`, or the same before pytest on one test file):
  an opt-in wide random search — fresh random draws, `SEARCH_EXAMPLES` examples per property
  test, no example database; a failure prints its `@reproduce_failure` blob and its drawn
  arguments, which go into the test as an explicit `@example`.

A test sets its example count with `examples(n)`, so that the search profile can raise it:
an explicit `@settings(max_examples=n)` would override any profile's.
"""

from __future__ import annotations

import os

from hypothesis import settings

SEARCH_EXAMPLES = 3000


def selected_profile() -> str:
    """`HYPOTHESIS_PROFILE` if set, else `ci` when `CI=true`, else `default`."""
    if "HYPOTHESIS_PROFILE" in os.environ:
        return os.environ["HYPOTHESIS_PROFILE"]
    return "ci" if os.environ.get("CI", "").lower() == "true" else "default"


def register_and_load_profiles() -> None:
    settings.register_profile("default", derandomize=True, database=None)
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile(
        "search", derandomize=False, max_examples=SEARCH_EXAMPLES, print_blob=True
    )
    profile = selected_profile()
    if profile not in ("default", "ci", "search"):
        raise ValueError(f"HYPOTHESIS_PROFILE={profile!r}: use one of default, ci, search")
    settings.load_profile(profile)


def examples(n: int) -> int:
    """A property test's example count: `n`, or the search profile's when that is loaded."""
    return settings().max_examples if selected_profile() == "search" else n
