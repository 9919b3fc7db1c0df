"""A regression model of one's own: an MLP that predicts a value from the 8 features of data.py's table."""

from torch import nn


def build(width: int = 64, depth: int = 2) -> nn.Module:
    """--model housing.models:build --model-args width=64,depth=2"""
    layers, features = [], 8
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU()]
        features = width
    return nn.Sequential(*layers, nn.Linear(features, 1))
