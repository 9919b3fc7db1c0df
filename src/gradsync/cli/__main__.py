"""`python -m gradsync.cli ...`: the same as the `gradsync` command."""

import sys

from gradsync.cli import main

sys.exit(main())
