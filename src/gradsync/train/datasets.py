"""Datasets that ship offline.

    digits       scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), scaled
                 to [0, 1]; a fixed 80/20 train/test split
    stdlib-text  the running interpreter's own standard-library sources (found with sysconfig),
                 read as bytes and cut into windows of context+1 bytes (input and next-byte target);
                 the last 10% of windows are the test set
    synthetic    random images and labels with a planted linear rule, for benchmarks
    stdlib-tokens  skip-gram samples [centre, context, negatives] over the stdlib's tokens (tokens.py)
"""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

import numpy

import torch
from torch.utils.data import TensorDataset

TEXT_BYTES = 2_000_000
"""How much standard-library source the text corpus reads (enough for several epochs of charlm)."""


def digits_file() -> Path:
    """scikit-learn's bundled digits.csv.gz, found without importing scikit-learn (a second and a half here:
    the launcher reads the data before any rank starts, and a bad flag must be refused in well under that)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the digits dataset is scikit-learn's: pip install scikit-learn")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 images as sklearn.datasets.load_digits gives them (its own file, read the way it reads it:
    64 pixel values 0..16 and the label per row), scaled to [0, 1], in a fixed 80/20 split by ``seed``."""
    table = numpy.loadtxt(digits_file(), delimiter=",")
    x = torch.tensor(table[:, :-1].reshape(-1, 8, 8), dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(table[:, -1].astype(int), dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def _stdlib_sources() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_text_windows(context: int = 64, max_bytes: int = TEXT_BYTES) -> int:
    """How many windows stdlib_text cuts (train and test), from the files' sizes alone."""
    total = 0
    for path in _stdlib_sources():
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return max(min(total, max_bytes) - 1, 0) // context


def stdlib_text(context: int = 64, max_bytes: int = TEXT_BYTES) -> tuple[TensorDataset, TensorDataset]:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in _stdlib_sources():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 10 * (context + 1):
        raise RuntimeError(f"found only {total} bytes of Python source under {root}; the stdlib-text dataset needs more")
    corpus = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).to(torch.int64)
    windows = corpus[:(len(corpus) - 1) // context * context + 1]
    n = (len(windows) - 1) // context
    starts = torch.arange(n) * context
    index = starts.unsqueeze(1) + torch.arange(context + 1)
    samples = windows[index]
    cut = int(0.9 * n)
    return (TensorDataset(samples[:cut, :-1], samples[:cut, 1:]), TensorDataset(samples[cut:, :-1], samples[cut:, 1:]))


def synthetic(n: int = 4096, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g)
    w = torch.randn(64, 10, generator=g)
    y = (x.flatten(1) @ w).argmax(1)
    cut = int(0.8 * n)
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])
