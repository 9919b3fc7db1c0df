"""CommContext: a communicator's own state, made once at init, kept by its transport.

What the collectives remember between calls on one communicator (gradsync's world, or one process
group of the "gradsync" backend) lives here, in one object, rather than written onto the transport
from outside: the sequence number every fingerprint carries (agree.py), the plans kept for the
shapes a program repeats (allreduce_one_shot.py, allreduce_two_shot.py, the native core's), the
algorithm auto chose per size (collectives.py), and host staging's buffers and streams
(host_staging.py). world_transport.build makes one and hands it to the transport it builds; the
transport closes it first when it closes (kept native plans hold the transport's addresses, host
staging page-locks its regions), as gloo's Context holds the state of one communicator above its
transport's pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KEEP_PLANS = 256
"""Plans and choices kept per communicator; a program with more shapes starts the cache again."""


@dataclass
class CommContext:
    """One communicator's state (module docstring)."""

    stage_cpu: bool = False
    """Every CPU tensor goes through host staging's copies too (GRADSYNC_HOST_STAGING=cpu: group/device_path.py)."""
    sequence: int = 0
    """The sequence number of the last collective entered (a fingerprint's second value)."""
    plans: dict = field(default_factory=dict)
    """Collectives made ready per shape: the all-reduce plans collectives.py keeps, and the native core's
    (kept_plan)."""
    algorithm_choices: dict = field(default_factory=dict)
    """(algorithm asked, bytes, on a GPU) -> the all-reduce algorithm that runs (collectives.resolve_algorithm)."""
    host_staging: object = None
    """The HostStaging of this communicator (host_staging.staging_of), made on first use."""

    def next_sequence(self) -> int:
        """The sequence number of the next collective."""
        self.sequence += 1
        return self.sequence

    def kept_plan(self, key: tuple, make, *args):
        """``make(*args)``, kept under ``key`` (None too: the Python path runs that shape)."""
        plans = self.plans
        if key not in plans:
            if len(plans) >= KEEP_PLANS:
                plans.clear()
            plans[key] = make(*args)
        return plans[key]

    def close(self) -> None:
        """Close host staging (its page-locked regions go before the transport unmaps them) and forget
        every plan and choice (native plans hold the transport's addresses)."""
        if self.host_staging is not None:
            self.host_staging.close()
            self.host_staging = None
        self.plans.clear()
        self.algorithm_choices.clear()
