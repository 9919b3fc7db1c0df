"""Numbers the documentation states (docs/transports.md), read from the page itself, so that a test checks
the claim a reader sees (and fails when the code and the page part ways) instead of the code's own constant."""

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "transports.md"
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def direct_below(world_size: int) -> int:
    """The bytes below which docs/transports.md says the shared-memory all-reduce takes the direct path (one
    barrier, every rank folds every copy) on ``world_size`` ranks of one host: "below 2 MiB with two
    ranks, 512 KiB with three and 256 KiB with four or more" (before the staging half's cap)."""
    text = " ".join(PAGE.read_text().split())
    found = re.search(r"below (\d+) (KiB|MiB) with two ranks, (\d+) (KiB|MiB) with three and (\d+) (KiB|MiB) "
                      r"with four or more", text)
    assert found, "docs/transports.md no longer states the direct/split bound in the words doc_claims.py reads"
    two, three, more = (int(found[i]) * UNITS[found[i + 1]] for i in (1, 3, 5))
    return {2: two, 3: three}.get(world_size, more)
