"""gradsync bench ddp: a training step, ours beside torch DDP (gloo); with --backend, torch's own DDP on each
torch.distributed backend (bench/ddp.py, bench/backend.py)."""

from __future__ import annotations

import json

from rich.table import Table

from gradsync.cli.args import keyword_arguments, positive_int
from gradsync.cli.output import show


def add_parser(benches) -> None:
    ddp = benches.add_parser("ddp", help="training step time, ours beside torch DDP (gloo)")
    ddp.add_argument("--workers", type=positive_int, default=2)
    ddp.add_argument("--model", default="mlp", metavar="mlp|cnn|charlm|module:function",
                     help="a benchmark model, or your own as gradsync train takes it (with --data)")
    ddp.add_argument("--data", metavar="module:function", help="with --model module:function: its data (the batch "
                     "is its first --batch-size training samples)")
    ddp.add_argument("--loss", metavar="RULE", help="with --model module:function: gradsync train's --loss")
    ddp.add_argument("--model-args", type=keyword_arguments("--model-args"), default={}, metavar="K=V,...",
                     help="with --model module:function: its keyword arguments, as gradsync train takes them")
    ddp.add_argument("--data-args", type=keyword_arguments("--data-args"), default={}, metavar="K=V,...",
                     help="with --data module:function: its keyword arguments")
    ddp.add_argument("--batch-size", type=positive_int, default=64, help="samples per rank")
    ddp.add_argument("--bucket-mb", default="1,25", help="comma-separated bucket caps for ours, in MiB")
    ddp.add_argument("--steps", type=positive_int, default=15, help="timed steps per implementation (median)")
    ddp.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ddp.add_argument("--torch-hook", action="store_true",
                     help="also ours with torch's allreduce_hook registered (its buckets over gloo)")
    ddp.add_argument("--compile", action="store_true",
                     help="also torch.compile (inductor) over torch DDP, over ours and under ours; with --backend: "
                          "torch.compile(DDP(model)) and the compiled floor on each backend")
    ddp.add_argument("--backend", metavar="LIST", help="instead: torch's own DDP on each torch.distributed backend "
                     "listed (e.g. gloo,gradsync), the first one the baseline; plus the torch API layer's cost")
    ddp.add_argument("--rounds", type=positive_int, default=3, help="with --backend: alternating runs per backend")
    ddp.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="cuda: every rank on cuda:0 (CUDA tensors through host memory), torch DDP on the gradsync "
                          "backend beside gloo's (default cpu)")


def run(args) -> int:
    from gradsync.bench import ddp

    if args.backend:
        return _bench_backends(args)

    try:
        caps = [float(c) for c in args.bucket_mb.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--bucket-mb {args.bucket_mb!r}: expected comma-separated numbers of MiB, e.g. 1,25") from None
    rows = ddp.run(args.workers, args.model, args.batch_size, caps, args.steps, torch_hook=args.torch_hook,
                   compiled=args.compile, device=args.device, data=args.data, loss=args.loss,
                   model_args=args.model_args, data_args=args.data_args)
    ours = next(r["transport"] for r in rows if r["impl"].startswith("gradsync"))
    table = Table(title=f"DDP step, {args.model} ({rows[0]['params'] / 1e6:.1f}M params), {args.workers} ranks, "
                        f"batch {args.batch_size}/rank, median of {args.steps}; ours over {ours}, torch DDP over gloo"
                        f"{', every rank on cuda:0' if args.device == 'cuda' else ''}")
    for column in ("implementation", "buckets", "step (ms)", "ours/torch", "vs floor", "overlap", "bytes/rank/step",
                   "loss after"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["impl"], "-" if r["buckets"] is None else str(r["buckets"]), f"{r['step_s'] * 1e3:.1f}",
                      "1.00 (baseline)" if r["impl"] == "torch DDP" else f"{r['ratio_vs_torch']:.2f}x",
                      f"{r['ratio_vs_floor']:.2f}x",
                      "-" if r["overlap"] is None else f"{r['overlap']:.0%}",
                      "-" if r["bytes_per_step"] is None else f"{r['bytes_per_step']:,}", f"{r['loss']:.6g}")
    show(table, rows, args.json, 100)
    return 0


def _bench_backends(args) -> int:
    from gradsync.bench import backend

    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if len(backends) < 1 or any(b not in ("gloo", "gradsync") for b in backends):
        raise ValueError(f"--backend {args.backend!r}: give a comma-separated list of gloo and gradsync, e.g. gloo,gradsync")
    steps, api = backend.run(args.workers, args.model, args.batch_size, args.steps, backends, args.rounds,
                             compiled=args.compile)
    table = Table(title=f"torch DDP step, {args.model}, {args.workers} ranks, batch {args.batch_size}/rank; median "
                        f"of {args.rounds} alternating runs (each the median of {args.steps} steps); floor: the bare "
                        f"model's step in the same runs; comm: the step minus the no-op hook's (DDP's own work)")
    for column in ("backend", "program", "step (ms)", f"/{backends[0]}", "vs floor", "comm (ms)", "each run (ms)"):
        table.add_column(column, justify="right")
    for r in steps:
        table.add_row(r["backend"], r["program"], f"{r['step_ms']:.1f}", f"{r['ratio']:.2f}x", f"{r['vs_floor']:.2f}x",
                      "-" if r["comm_ms"] is None else f"{r['comm_ms']:.1f}", ", ".join(f"{t:.1f}" for t in r["runs_ms"]))
    show(table, steps, None, 110)
    if api:
        table = Table(title="all_reduce through torch's API on the gradsync backend beside gs.all_reduce, same ranks")
        for column in ("bytes", "dist.all_reduce (us)", "gs.all_reduce (us)", "api/direct"):
            table.add_column(column, justify="right")
        for r in api:
            table.add_row(f"{r['bytes']:,}", f"{r['api_us']:.0f}", f"{r['direct_us']:.0f}", f"{r['ratio']:.2f}x")
        show(table, api, None, 110)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "api": api}, f, indent=2)
    return 0
