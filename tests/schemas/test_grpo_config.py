"""GRPOConfig: TRL 1.16 names and defaults, validation messages that name the field and the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from longstraw.schemas.grpo import GRPOConfig


def test_defaults_follow_trl():
    cfg = GRPOConfig()
    assert cfg.loss_type == "dapo"
    assert (cfg.epsilon, cfg.epsilon_high, cfg.effective_epsilon_high) == (0.2, None, 0.2)
    assert (cfg.beta, cfg.scale_rewards, cfg.importance_sampling_level) == (0.0, "group", "token")
    assert (cfg.num_generations, cfg.num_iterations, cfg.delta) == (8, 1, None)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon) == (0.9, 0.999, 1e-8)


def test_every_field_has_a_docstring():
    missing = [name for name, f in GRPOConfig.model_fields.items() if not f.description]
    assert not missing, missing


def test_config_is_frozen():
    cfg = GRPOConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.beta = 0.1


def test_unknown_key_is_rejected_by_name():
    with pytest.raises(ValidationError, match=r"epsilon_hi\n.*Extra inputs are not permitted"):
        GRPOConfig(epsilon_hi=0.28)


@pytest.mark.parametrize("value", [True, False])
def test_bool_scale_rewards_is_accepted_as_trl_does(value):
    assert GRPOConfig(scale_rewards=value).scale_rewards == ("group" if value else "none")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_generations", 1),
        ("loss_type", "ppo"),
        ("scale_rewards", "std"),
        ("importance_sampling_level", "batch"),
        ("epsilon", -0.1),
        ("epsilon", 1.0),
        ("beta", -0.01),
        ("temperature", 0.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("min_p", 1.5),
        ("max_completion_length", 0),
        ("num_iterations", 0),
        ("learning_rate", 0.0),
        ("adam_beta2", 1.0),
        ("adam_epsilon", 0.0),
        ("max_grad_norm", -1.0),
        ("warmup_steps", -1),
        ("warmup_steps", 2.5),
        ("reward_weights", [1.0, float("nan")]),
        ("reward_weights", []),
    ],
)
def test_out_of_range_value_error_names_the_field(field, value):
    with pytest.raises(ValidationError) as exc:
        GRPOConfig(**{field: value})
    assert field in str(exc.value), str(exc.value)


def test_epsilon_high_below_epsilon_says_what_to_change():
    with pytest.raises(ValidationError) as exc:
        GRPOConfig(epsilon=0.2, epsilon_high=0.1)
    message = str(exc.value)
    assert "epsilon_high must be >= epsilon (got 0.1 < 0.2)" in message, message
    assert "leave it unset" in message


def test_delta_at_or_below_one_says_what_to_change():
    with pytest.raises(ValidationError, match=r"delta must be > 1 \(got 0.9\).*> 1.28"):
        GRPOConfig(delta=0.9, epsilon_high=0.28)
    assert GRPOConfig(delta=1.5).delta == 1.5


def test_warmup_steps_takes_steps_or_a_ratio():
    assert GRPOConfig(warmup_steps=10).warmup_steps == 10
    assert GRPOConfig(warmup_steps=0.1).warmup_steps == 0.1


def test_round_trips_through_json():
    cfg = GRPOConfig(loss_type="dr_grpo", epsilon_high=0.28, beta=0.04, reward_weights=[1.0, 0.5])
    assert GRPOConfig.model_validate_json(cfg.model_dump_json()) == cfg
