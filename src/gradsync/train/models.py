"""Models for gradsync train: a CNN for 8x8 digit images, an MLP, and a small character-level transformer."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a classifier for 1x8x8 images, 10 classes (~140K parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Fully connected layers; ``hidden`` sets the width (the benchmark MLP uses 2048 x 3)."""

    def __init__(self, in_features: int = 64, hidden: int = 256, layers: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        blocks, width = [nn.Flatten()], in_features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        blocks.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CharLM(nn.Module):
    """A causal transformer over bytes: vocab 256, context ``context``, pre-norm encoder blocks."""

    def __init__(self, context: int = 64, d_model: int = 128, heads: int = 4, layers: int = 2, vocab: int = 256) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.position[:length]
        h = self.blocks(h, mask=self.causal[:length, :length], is_causal=True)
        return self.head(self.norm(h))
