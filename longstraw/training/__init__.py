"""The GRPO training loop as plain functions (Prefect tasks wrap them; nothing here imports Prefect)."""
