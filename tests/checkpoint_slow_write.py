"""`gradsync train` in this process with every checkpoint write slowed down: each save first sleeps
SECONDS (argv[1]) and only then serialises what it was given. A checkpoint written from the live
tensors instead of a snapshot would hold a later step's values; one written on the training thread
would stall training for SECONDS each time (tests/test_train.py). Use --strategy local (the training
runs in this process, where the patch applies)."""

import sys
import time

from gradsync import checkpoint
from gradsync.cli import main

_real_save = checkpoint.save
_delay = float(sys.argv[1])


def _slow_save(path, state):
    time.sleep(_delay)
    return _real_save(path, state)


checkpoint.save = _slow_save
sys.exit(main(sys.argv[2:]))
