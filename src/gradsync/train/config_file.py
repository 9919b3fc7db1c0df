"""`gradsync train --config run.toml`: any flag set by its name in a TOML file (the standard library's
tomllib), and the resolved config every run directory keeps as config.toml.

    # run.toml
    model = "my_pkg.models:build"
    data = "my_pkg.data:build"
    loss = "mse"
    workers = 4
    batch-size = 64                  # a flag's name, with dashes or underscores
    lr-schedule = "cosine"
    [model-args]                     # the factories' keyword arguments, as tables
    depth = 4
    width = 256

Flags given on the command line override the file. An unknown key is one line naming it and the
nearest valid one. A run writes the config it resolved (the file's values, the flags, the defaults
filled in: the model and its data) to RUN_DIR/config.toml, so `gradsync train --config
RUN_DIR/config.toml --out OTHER` trains the same run again.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from pathlib import Path

from gradsync.train.factory import parse_arguments

CONFIG_NAME = "config.toml"
ALIASES = {"data": "dataset"}
"""Keys that name a field by another of its flags (--data is --dataset)."""
LEFT_OUT = ("resume", "overwrite")
"""Fields that say how a command was run, not what it trains: not written to config.toml."""


def read(path: str | Path, fields: dict) -> dict:
    """The TrainConfig field values ``path`` sets (``fields``: TrainConfig's dataclass fields)."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path} is not valid TOML: {exc}") from None
    values = {}
    for key, value in table.items():
        name = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in fields or name == "config":
            known = sorted({f.replace("_", "-") for f in fields} | set(ALIASES))
            nearest = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
            raise ValueError(f"--config {path}: unknown key {key!r}"
                             + (f"; did you mean {nearest[0]!r}?" if nearest else f"; the keys are the flags' names"))
        if name.endswith("_args") and isinstance(value, str):
            value = parse_arguments(value, f"--config {path}: {key}")
        values[name] = value
    return values


def write(cfg, directory: str | Path) -> Path:
    """``cfg``'s fields (None ones left out: TOML has no null, and None is every such field's default) as
    RUN_DIR/config.toml; tables last, as TOML requires."""
    plain, tables = [], []
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name in LEFT_OUT or value is None:
            continue
        key = field.name.replace("_", "-")
        if isinstance(value, dict):
            tables.append(f"\n[{key}]\n" + "".join(f"{k} = {_value(v)}\n" for k, v in value.items()))
        else:
            plain.append(f"{key} = {_value(value)}\n")
    path = Path(directory) / CONFIG_NAME
    path.write_text("# the resolved config of this run: gradsync train --config THIS_FILE --out DIR trains it again\n"
                    + "".join(plain) + "".join(tables))
    return path


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if not isinstance(value, float) or value == value and abs(value) != float("inf") \
            else ("nan" if value != value else ("inf" if value > 0 else "-inf"))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise ValueError(f"config.toml cannot hold {value!r} ({type(value).__name__})")
