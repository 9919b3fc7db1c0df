"""Code that torch.compile must leave to Python: run it eagerly, without importing the compiler.

torch.compiler.disable marks a function to run eagerly under torch.compile (dynamo skips its
frame and graph-breaks around the call), 0.4 us a call. Applying it imports torch._dynamo, a
second of every process's start (1.4 s per rank measured here), which a program that never
compiles should not pay. ``eager(function)`` waits: the function runs as it is until something in
the process has imported dynamo (torch.compile does, before it traces anything), and only then is
it wrapped by torch.compiler.disable, once. The cost before is one dictionary lookup a call.
"""

from __future__ import annotations

import functools
import sys

import torch


def eager(function):
    """``function`` run eagerly under torch.compile, with dynamo loaded only when a program loads it."""
    disabled = []

    @functools.wraps(function)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:  # nothing can compile in this process yet
            return function(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(function, recursive=True))
        return disabled[0](*args, **kwargs)
    return call
