"""Experiment trackers: each recorded step's metrics sent to TensorBoard, MLflow, W&B or Trackio.

`open_trackers(config, recorded)` (run_trackers.py) opens the trackers `tracking.report_to` names, one
module each behind the `Tracker` protocol (tracker.py); `metric_names.py` maps a step's record
to TRL's metric names and LongStraw's own; `completions.py` keeps the step's table of sampled
completions. Everything is written under the run's directory, offline.
"""
