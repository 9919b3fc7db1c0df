"""Every strategy of `gradsync train`, declared once: what it is, what it needs, what live mode, resume,
clipping and compression do with it. TrainConfig's checks, the help, the batch line and the loop read
these declarations; the loop calls the strategy's object (``strategy(name).object``) and tests no name.

    name       ranks                      one step                                        live mode
    ddp        every rank trains          all-reduce of the gradients in backward (ddp/)  LiveDDP
    zero1      every rank trains          reduce-scatter, shard update, all-gather        refused
    local      one process                the optimizer alone                              refused
    diloco     every rank trains alone    every --sync-every steps, an outer step          refused
    ps-sync    --servers serve, W train   pull, compute, push; the servers average W       LivePS
    ps-async   --servers serve, W train   each push applied on its own                     LivePS
    ssp        --servers serve, W train   async, no worker --staleness steps ahead         LivePS
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """One strategy's declaration (module docstring)."""

    name: str
    help: str
    """One line for `gradsync train --help`."""
    object: str
    """module:Class of the object the loop calls (one rank's side of the strategy)."""
    live_object: str | None
    """module:Class under --fault-tolerance live; None: refused, for ``live_refused``."""
    live_refused: str | None = None
    """Why --fault-tolerance live is refused (None where it runs)."""
    ps_mode: str | None = None
    """The parameter server's mode (sync, async, ssp): the first --servers ranks serve; None: every rank trains."""
    family: str | None = None
    """Strategies whose checkpoints resume each other (the same weights and whole optimizer state)."""
    clip_site: str = ""
    """Where --clip-grad takes the norm and clips (the batch line says it)."""
    lr_scaled: bool = True
    """Whether the learning rate follows the global batch (False: each worker steps alone on its own)."""
    share: str = "step"
    """How a rank's loss is weighed: 'step', the ranks' averaged gradient is the mean over the step's samples;
    'own', each rank's gradient is the mean over its own share (it steps alone, or each push counts alone)."""
    compress: tuple[str, ...] = ("none",)
    """The --compress values it applies (the rest are refused, not ignored)."""
    uses_algorithm: bool = False
    """Whether its collectives follow --algorithm."""
    periodic_checkpoints: str | None = None
    """Why --checkpoint-every is refused (None where it is taken)."""
    restarts: str | None = None
    """Why --max-restarts (restart after a failure) is refused (None where it is taken)."""
    one_process: bool = False
    """It runs in one process (--workers 1)."""

    def load(self, live: bool):
        """The class of the object the loop calls (live: under --fault-tolerance live)."""
        module, _, name = (self.live_object if live else self.object).partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def serves(self) -> bool:
        return self.ps_mode is not None


_PS_ONLY_AT_ENDS = ("a parameter-server job checkpoints on preemption and at its end only (its servers and "
                    "workers reach a common point only when they stop)")
_PACKAGE = "gradsync.train.strategies"


def _ps(name: str, mode: str, help: str, clip_site: str, share: str) -> Strategy:
    return Strategy(name, help, f"{_PACKAGE}.ps:ParameterServerStrategy", f"{_PACKAGE}.live_ps:LiveParameterServer",
                    ps_mode=mode, family=name, clip_site=clip_site, share=share,
                    periodic_checkpoints=_PS_ONLY_AT_ENDS,
                    restarts=f"{_PS_ONLY_AT_ENDS}, so a restart after a failure would start over; use ddp, zero1 "
                             f"or local, or --resume after a preemption")


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("ddp", "all-reduce the gradients in backward, bucket by bucket (the DDP wrapper)",
             f"{_PACKAGE}.ddp:DataParallel", f"{_PACKAGE}.live_ddp:LiveDataParallel",
             family="ddp|zero1|local", clip_site="torch's clip_grad_norm_ on the all-reduced .grad",
             compress=("none", "fp16", "bf16", "powersgd"), uses_algorithm=True),
    Strategy("zero1", "shard the optimizer state (ZeRO-1): reduce-scatter, update a shard, all-gather",
             f"{_PACKAGE}.unwrapped:Unwrapped", None,
             live_refused="ZeRO-1 keeps each rank's optimizer state shard on that rank alone, and live mode keeps no "
                          "buddy copy of it, so a dead rank's shard would be lost",
             family="ddp|zero1|local", clip_site="ShardedOptimizer.clip_grad_norm_: shard norms, 1 scalar all-reduce",
             uses_algorithm=True),
    Strategy("local", "one process, no communication", f"{_PACKAGE}.unwrapped:Unwrapped", None,
             live_refused="one process has no survivors", family="ddp|zero1|local",
             clip_site="torch's clip_grad_norm_", one_process=True),
    Strategy("diloco", "each worker trains alone; every --sync-every steps the replicas' average movement takes "
                       "one outer step (DiLoCo)", f"{_PACKAGE}.diloco:DiLoCoStrategy", None,
             live_refused="DiLoCo's replicas differ between outer steps, and live mode keeps no copy of a dead "
                          "worker's",
             family="diloco", clip_site="torch's clip_grad_norm_ on each worker's own gradient, every inner step",
             lr_scaled=False, share="own", uses_algorithm=True),
    _ps("ps-sync", "sync", "the first --servers ranks hold the parameters; each version averages every worker's push",
        "on the servers, the version's averaged gradient, norm over all shards", "step"),
    _ps("ps-async", "async", "parameter server; each push is applied on its own (asynchronous SGD)",
        "on each worker, its own push", "own"),
    _ps("ssp", "ssp", "parameter server, asynchronous, no worker more than --staleness steps ahead of the slowest",
        "on each worker, its own push", "own"),
)}
"""The registry: every strategy, in the order --help lists them."""

PS_STRATEGIES = tuple(name for name, s in STRATEGIES.items() if s.serves)


def strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"--strategy {name!r} is not one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]
