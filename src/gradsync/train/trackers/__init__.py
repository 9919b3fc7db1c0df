"""The experiment trackers `gradsync train --log` records to, each behind one interface (base.Tracker:
log(step, values), finish(done)) and each an optional extra of its own:

    name         what it writes                                       extra (pip install "gradsync[EXTRA]")
    tensorboard  event files in RUN_DIR/tensorboard/ (torch's SummaryWriter)         tensorboard
    wandb        a W&B run, offline: RUN_DIR/wandb/offline-run-*-ID/run-ID.wandb     wandb
    mlflow       an MLflow run in a local file store, RUN_DIR/mlruns/                mlflow

Which are installed is checked in the launcher before any rank starts (train/runs.py check_trackers);
only the reporting rank imports them, when it first records (train/tracking.py).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class TrackerKind:
    name: str
    object: str
    """module:Class of the tracker (base.Tracker's interface)."""
    imports: str
    """The top-level module the tracker needs (looked up, not imported, by the launcher's check)."""
    extra: str
    """The optional extra in pyproject.toml that installs it."""
    package: str
    """The package that module comes from, as pip names it."""

    def load(self):
        module, _, name = self.object.partition(":")
        return getattr(importlib.import_module(module), name)


TRACKERS: dict[str, TrackerKind] = {k.name: k for k in (
    TrackerKind("tensorboard", f"{__name__}.tensorboard_events:TensorBoardTracker", "tensorboard", "tensorboard",
                "tensorboard"),
    TrackerKind("wandb", f"{__name__}.wandb_offline:WandbTracker", "wandb", "wandb", "wandb"),
    TrackerKind("mlflow", f"{__name__}.mlflow_store:MlflowTracker", "mlflow", "mlflow", "mlflow-skinny"),
)}
"""Every tracker --log takes, in the order its help lists them."""


def tracker_names(text: str) -> list[str]:
    """The trackers ``text`` (--log's value: names, comma-separated) names, in order, each once."""
    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"--log {name!r} is not one of: {', '.join(TRACKERS)} (several comma-separated, e.g. "
                             f"--log tensorboard,mlflow)")
    return list(dict.fromkeys(names))


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found, not imported: mlflow and wandb take seconds to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(names: list[str]) -> None:
    """One line naming the install command for the first tracker in ``names`` that is not installed."""
    for name in names:
        kind = TRACKERS[name]
        if not installed(kind.imports):
            raise RuntimeError(f"--log {name} needs the {kind.package} package, which is not installed: "
                               f"pip install \"gradsync[{kind.extra}]\" (in a checkout: pip install -e \".[{kind.extra}]\")")
