"""Exact mode's deterministic algorithms and what CUDA needs for them."""

import os

import torch

from longstraw.engine.group import CUBLAS_DETERMINISTIC_WORKSPACE, deterministic_algorithms


def test_deterministic_mode_sets_cublas_workspace_on_cuda_and_restores_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC_WORKSPACE
    assert torch.are_deterministic_algorithms_enabled() == before


def test_a_users_cublas_workspace_setting_stands(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_algorithms():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_without_cuda_the_environment_is_left_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with deterministic_algorithms():
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
