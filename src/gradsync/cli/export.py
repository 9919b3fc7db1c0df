"""gradsync export RUN_DIR [--format safetensors|pt] [--out FILE]: a run's trained weights as a plain state
dict (gradsync/train/export.py)."""

from __future__ import annotations


def add_parser(commands) -> None:
    from gradsync.train.export import FORMATS

    export = commands.add_parser("export", help="a run's trained weights as a plain state dict (safetensors or pt)")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a --out directory of gradsync train (its checkpoint.pt)")
    export.add_argument("--format", choices=FORMATS, default=None,
                        help="safetensors (safetensors.torch.load_file; pip install \"gradsync[safetensors]\") or pt "
                             "(torch.load(FILE, weights_only=True)) (default: --out's suffix, else safetensors)")
    export.add_argument("--out", metavar="FILE", default=None, help="where to write (default: RUN_DIR/model.FORMAT)")


def run(args) -> int:
    from gradsync.train.export import export

    _, _, said = export(args.run_dir, args.format, args.out)
    for line in said.splitlines():
        print(f"gradsync export: {line}")
    return 0
