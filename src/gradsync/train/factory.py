"""A user's code named on the command line: ``module:function``, and the keyword arguments it takes.

    --model my_pkg.models:build --model-args depth=4,width=256
    --data my_pkg.data:build --data-args root=/data/x,download=False

The module is imported as uvicorn and LightningCLI import it: from the working directory first (it is
put at the front of sys.path, as ``python -m`` does), then the environment. The name after the colon
may be dotted (``pkg.mod:Builder.build``) and may be a class (``pkg.mod:MyModel``): anything callable.

Keyword values are Python literals where they parse as one (4, 0.1, True, None, "text", (1, 2)) and
text otherwise (``root=/data/x``). Every failure is one line naming the flag, the value and what is
accepted (ValueError); a factory that raises is reported the same way, with its exception's line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
from typing import Any, Callable


def is_spec(text: str) -> bool:
    """Whether ``text`` has the ``module:function`` form (a built-in name has no colon)."""
    module, _, name = text.partition(":")
    return bool(module.strip()) and bool(name.strip())


def load(spec: str, flag: str) -> Callable:
    """The callable ``spec`` (``module:function``) names; ValueError naming ``flag`` if it cannot be had."""
    if not is_spec(spec):
        raise ValueError(f"{flag} {spec!r}: give module:function (e.g. my_pkg.models:build), importable from the "
                         f"working directory or the environment")
    module_name, _, attribute = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        target: Any = importlib.import_module(module_name.strip())
    except Exception as exc:   # ImportError, or the module's own top-level code failing
        raise ValueError(f"{flag} {spec}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); give "
                         f"module:function importable from the working directory ({here}) or the environment") from None
    for part in attribute.strip().split("."):
        if not hasattr(target, part):
            public = sorted(n for n, v in vars(target).items() if callable(v) and not n.startswith("_"))[:12] \
                if inspect.ismodule(target) else []
            raise ValueError(f"{flag} {spec}: {getattr(target, '__name__', target)!s} has no attribute {part!r}"
                             + (f"; its callables: {', '.join(public)}" if public else ""))
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{flag} {spec}: {attribute} is a {type(target).__name__}, not a function or class")
    return target


def parse_arguments(text: str, flag: str) -> dict:
    """``depth=4,width=256,name=x`` -> {"depth": 4, "width": 256, "name": "x"}; commas inside brackets or
    quotes do not split (``sizes=(1, 2)``)."""
    result: dict = {}
    for item in _split_top_level(text):
        if not item.strip():
            continue
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or not key.isidentifier():
            raise ValueError(f"{flag} {text!r}: {item.strip()!r} is not name=value; give e.g. depth=4,width=256")
        result[key] = literal(value.strip())
    return result


def literal(text: str):
    """A Python literal where ``text`` is one, else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _split_top_level(text: str) -> list[str]:
    parts, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def call(factory: Callable, kwargs: dict, flag: str, spec: str, seed: int | None = None):
    """``factory(**kwargs)``, passing ``seed`` too when the factory takes one and it was not given; a
    factory that rejects its arguments or raises is one line naming ``flag``."""
    kwargs = dict(kwargs)
    if seed is not None and "seed" not in kwargs and _accepts(factory, "seed"):
        kwargs["seed"] = seed
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{flag} {spec}: cannot take the arguments {kwargs} ({exc})") from None
    except ValueError:   # no signature (a builtin): let the call say
        pass
    try:
        return factory(**kwargs)
    except Exception as exc:
        raise ValueError(f"{flag} {spec} raised {type(exc).__name__}: {exc}") from exc


def _accepts(factory: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters
