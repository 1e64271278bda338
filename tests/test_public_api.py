"""The package's front door: the names users import from `longstraw`, and its runnable example."""

from __future__ import annotations

import doctest

import longstraw


def test_public_names_import_from_the_package():
    from longstraw import (
        GRPOConfig,
        RunConfig,
        accumulate_group_gradients,
        branch_logprobs,
        prefill,
    )
    from longstraw.engine import prefill as engine_prefill

    assert prefill is engine_prefill
    assert callable(branch_logprobs) and callable(accumulate_group_gradients)
    assert GRPOConfig().loss_type and RunConfig().run_id
    assert set(longstraw.__all__) >= {"prefill", "GRPOConfig", "RunConfig", "train"}


def test_package_docstring_example_runs():
    failures, tried = doctest.testmod(longstraw, optionflags=doctest.ELLIPSIS)
    assert tried >= 10 and failures == 0
