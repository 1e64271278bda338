"""What a run leaves in the Prefect UI, its audit trail: task run names, tags and each step's
audit lines (`names`), the run's curves (`curves`) and sampled completions (`completions`) as
artifacts, redrawn from the run's recorded steps.
"""
