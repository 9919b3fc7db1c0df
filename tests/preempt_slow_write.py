"""`gradsync train` in this process, with every checkpoint write after the first slowed down: the
fsync of the temporary file creates OUT/writing and then takes 3 s, a window wide enough for a test
to send a second signal while the write is under way (tests/test_preempt.py). Use --strategy local
(the training runs in this process, where the patch applies)."""

import os
import sys
import time
from pathlib import Path

from gradsync.cli import main

_real_fsync = os.fsync
_writes = [0]


def _slow_fsync(fd: int) -> None:
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = ""
    if Path(name).name.startswith(".checkpoint.pt.tmp-"):
        _writes[0] += 1
        if _writes[0] > 1:
            (Path(name).parent / "writing").write_text("")
            time.sleep(3.0)
    _real_fsync(fd)


os.fsync = _slow_fsync
sys.exit(main(sys.argv[1:]))
