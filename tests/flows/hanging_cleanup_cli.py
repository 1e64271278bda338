"""`longstraw` whose cleanup after an interrupt hangs (the run lease's release never returns),
with a 2 s watchdog: the forced exit's path, for test_interrupt.py. Run as
`python -m hanging_cleanup_cli train ...`."""

import time

import longstraw.train_entry as train_entry
import longstraw.training.run_lease as run_lease

train_entry.FORCE_EXIT_AFTER_S = 2.0
run_lease._release = lambda *args, **kwargs: time.sleep(3600)

from longstraw.cli import main  # noqa: E402

main()
