"""gradsync export RUN_DIR: a run's trained weights as a plain state dict, in the formats other tools load.

What is written: the checkpoint's "model" (RUN_DIR/checkpoint.pt, train/resume.py), each tensor
copied to the CPU, contiguous and on its own (tied weights are written once per name, as
safetensors requires), with no gradsync header (checkpoint.py's magic and checksum are gone):

    safetensors   safetensors.torch.save_file; load with safetensors.torch.load_file(FILE)
                  (metadata: format "pt", the run's model, strategy and step)
    pt            torch.save of the state dict; load with torch.load(FILE, weights_only=True)

Either loads into the model the same factory builds (Task.of(cfg).build_model(), or the user's own
module:function) with load_state_dict, strict.

The checkpoint's model is the whole trained model for every strategy: ddp and local hold the replica;
ZeRO-1's ranks all-gather the updated parameters every step, so rank 0's replica is whole (its
optimizer state, sharded, is not exported); a parameter server's checkpoint holds the servers'
parameters copied into the model by rank 0 (strategies/ps.py save_at_end: every server's shards,
sparse tables included); DiLoCo's holds rank 0's replica, which at an outer step (every
--sync-every steps, every epoch's end, so a run's end) is the replicas' agreed model. A DiLoCo
checkpoint written between outer steps (a preemption mid-round) holds rank 0's replica as it was
then, not an average: the export says so, and `gradsync train --resume` to the round's end gives
the averaged model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gradsync import checkpoint
from gradsync.train.resume import CHECKPOINT_NAME
from gradsync.train.trackers import installed

FORMATS = ("safetensors", "pt")
SUFFIXES = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt", ".bin": "pt"}


def format_of(fmt: str | None, out: str | None) -> str:
    """--format, else the one --out's suffix names, else safetensors."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"--format {fmt!r} is not one of: {', '.join(FORMATS)}")
        return fmt
    return SUFFIXES.get(Path(out).suffix, "safetensors") if out else "safetensors"


def read_weights(run_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(the state dict, what the checkpoint says of its run, notes to print) of RUN_DIR's checkpoint."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a directory; give a --out directory of gradsync train")
    path = run_dir / CHECKPOINT_NAME
    if not path.exists():
        raise ValueError(f"{run_dir} holds no checkpoint ({CHECKPOINT_NAME}); give a --out "
                         f"directory of gradsync train whose run wrote one")
    state = checkpoint.load(path)   # a torn or foreign file: CheckpointError, one line
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict) or not model:
        raise checkpoint.CheckpointError(f"{path} holds no model weights (no \"model\" state dict)")
    foreign = [name for name, value in model.items() if not isinstance(value, torch.Tensor)]
    if foreign:
        raise checkpoint.CheckpointError(f"{path}: the model's state dict holds {foreign[0]!r}, a "
                                         f"{type(model[foreign[0]]).__name__}, not a tensor: it cannot be exported")
    weights = {name: value.detach().to("cpu").contiguous().clone() for name, value in model.items()}
    identity = state.get("identity", {})
    about = {"model": str(identity.get("model")), "strategy": str(identity.get("strategy")),
             "step": str(state.get("step"))}
    notes = []
    diloco = state.get("diloco")
    if diloco and diloco.get("inner_steps", 0) % max(diloco.get("sync_every", 1), 1):
        done = diloco["inner_steps"] % diloco["sync_every"]
        notes.append(f"the DiLoCo checkpoint is mid-round ({done} of {diloco['sync_every']} inner steps since the "
                     f"last outer step): exported rank 0's replica as it was then, not the replicas' average; "
                     f"gradsync train --resume to the round's end gives the averaged model")
    return weights, about, notes


def export(run_dir: str | Path, fmt: str | None = None, out: str | Path | None = None) -> tuple[Path, str, str]:
    """Write RUN_DIR's trained weights (module docstring); (the file, its format, what was written in words,
    notes first)."""
    fmt = format_of(fmt, str(out) if out else None)
    if fmt == "safetensors" and not installed("safetensors"):
        raise RuntimeError("--format safetensors needs the safetensors package, which is not installed: pip install "
                           "\"gradsync[safetensors]\" (in a checkout: pip install -e \".[safetensors]\"); or --format pt")
    weights, about, notes = read_weights(run_dir)
    target = Path(out) if out else Path(run_dir) / f"model.{fmt}"
    if not target.parent.is_dir():
        raise ValueError(f"--out {target}: cannot write it: the directory {target.parent} does not exist")
    partial = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(weights, str(partial), metadata={"format": "pt", **{f"gradsync.{k}": v for k, v in about.items()}})
        else:
            torch.save(weights, partial)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)   # as any file this user writes (safetensors creates its own 0600)
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ValueError(f"--out {target}: cannot write it ({exc.strerror or exc})") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    size = sum(w.numel() * w.element_size() for w in weights.values())
    said = "".join(f"{line}\n" for line in notes) + (
        f"wrote {target} ({fmt}, {len(weights)} tensors, {size / 2**20:.2f} MiB): the weights of {about['model']} "
        f"trained with --strategy {about['strategy']} to step {about['step']}, a plain state dict")
    return target, fmt, said
