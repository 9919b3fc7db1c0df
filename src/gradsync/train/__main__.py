"""`python -m gradsync.train ...` (for torchrun): the same flags as `gradsync train`."""

import sys

from gradsync.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
