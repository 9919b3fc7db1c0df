"""The strategies of `gradsync train`: one registry (registry.py) and one object a strategy (the other
modules), which the loop (train/loop.py) calls and never names."""

from gradsync.train.strategies.registry import PS_STRATEGIES, STRATEGIES, Strategy, strategy

__all__ = ["PS_STRATEGIES", "STRATEGIES", "Strategy", "strategy"]
