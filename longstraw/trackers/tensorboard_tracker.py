"""TensorBoard: event files under `runs/<run_id>/trackers/tensorboard` (one per process; a resumed
run adds its own file to the same directory, so TensorBoard shows one run)."""

from __future__ import annotations

from pathlib import Path

from longstraw.schemas.run import RunConfig
from longstraw.trackers.tracker import Held, markdown_table, tracker_dir

TEXT_SUFFIX = "/text_summary"
"""TensorBoard's tag of a text summary named `<name>`: `<name>/text_summary`."""


def read_tensorboard(directory: Path) -> Held:
    """step -> scalar tags and text names the event files in `directory` hold."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    held: Held = {}
    if not any(directory.glob("events.out.tfevents.*")):
        return held
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    for tag in tags["scalars"]:
        for event in events.Scalars(tag):
            held.setdefault(event.step, set()).add(tag)
    for tag in tags["tensors"]:
        if tag.endswith(TEXT_SUFFIX):
            for event in events.Tensors(tag):
                held.setdefault(event.step, set()).add(tag.removesuffix(TEXT_SUFFIX))
    return held


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, config: RunConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = tracker_dir(config, self.name)
        self._held = read_tensorboard(self.directory)  # before this process adds its file
        self.writer = SummaryWriter(str(self.directory))

    def logged(self) -> Held:
        return self._held

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), step)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
