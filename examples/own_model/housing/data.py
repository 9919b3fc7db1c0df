"""The data of one's own: a table of 8 standardised features and a value that depends on them
non-linearly, 20,000 rows, 80% to train and 20% to test. Any map-style torch Dataset works the same way."""

import torch
from torch.utils.data import TensorDataset


def build(rows: int = 20_000, noise: float = 0.1, seed: int = 0):
    """--data housing.data:build --data-args rows=20000 (gradsync passes seed=--seed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    value = (x[:, 0] * x[:, 1]).tanh() + 0.5 * x[:, 2].sin() - 0.3 * x[:, 3] + noise * torch.randn(rows, generator=g)
    cut = int(0.8 * rows)
    return TensorDataset(x[:cut], value[:cut, None]), TensorDataset(x[cut:], value[cut:, None])
