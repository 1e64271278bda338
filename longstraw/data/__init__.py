"""Synthetic long-context tasks and the users' JSONL prompt/response formats (docs/data.md)."""

from longstraw.data.haystack import HaystackTaskConfig, generate_haystack_task
from longstraw.data.jsonl import (
    DataFormatError,
    PromptRecord,
    ResponseRecord,
    read_prompt_dataset,
    read_response_file,
    write_jsonl,
)
from longstraw.data.rewards import haystack_exact, haystack_partial, register_haystack_rewards
from longstraw.data.tasks import (
    TaskExample,
    generate_task,
    get_task_generator,
    register_task,
    task_names,
    write_task_dataset,
)

__all__ = [
    "DataFormatError",
    "HaystackTaskConfig",
    "PromptRecord",
    "ResponseRecord",
    "TaskExample",
    "generate_haystack_task",
    "generate_task",
    "get_task_generator",
    "haystack_exact",
    "haystack_partial",
    "read_prompt_dataset",
    "read_response_file",
    "register_haystack_rewards",
    "register_task",
    "task_names",
    "write_jsonl",
    "write_task_dataset",
]
