"""The built-in tasks: four models and four datasets that ship offline, declared as a user declares one.

Each built-in name stands for a ``module:function`` (what --model and --data take from a user) and the
model's defaults: its optimizer, base learning rate and, where it has one, its own loss function. The
loops never see these names: they train a Task (train/task.py), whichever way it was named.

    model     factory                                   natural data    optimizer, base lr
    cnn       gradsync.train.models:DigitsCNN           digits          sgd 0.02, momentum 0.9
    mlp       gradsync.train.models:MLP                 digits          sgd 0.02, momentum 0.9
    charlm    gradsync.train.models:CharLM              stdlib-text     adamw 1e-3, weight decay 0.01
    word2vec  gradsync.train.word2vec:skip_gram         stdlib-tokens   adagrad 0.2 (per-row step sizes),
                                                                        loss word2vec:negative_sampling_loss
A user's model without defaults of its own trains with USER_DEFAULTS (AdamW at 1e-3, torch's weight
decay 0.01), the usual starting point for a model one knows nothing about.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelDefaults:
    """A model's factory and what it trains with unless a flag says otherwise."""

    factory: str
    """module:function that builds it."""
    optimizer: str = "adamw"
    """--optimizer's default for it."""
    hyper: dict = field(default_factory=lambda: {"lr": 1e-3, "weight_decay": 0.01})
    """lr, and weight_decay / momentum where they differ from the optimizer's own defaults."""
    loss: str = "auto"
    """--loss's default for it."""
    data: str | None = None
    """Its natural dataset: what --data defaults to (built-in models only)."""
    steps: int | None = None
    """Steps a run trains without --epochs or --steps (None: the batch math's default length)."""
    accuracy: str = "test accuracy"
    """What the summary calls its accuracy."""
    after: str | None = None
    """module:function called with the trained parameters after the run (word2vec's neighbours)."""


USER_DEFAULTS = ModelDefaults(factory="")
"""What a user's model (--model module:function) trains with by default."""

MODELS = {
    "cnn": ModelDefaults("gradsync.train.models:DigitsCNN", "sgd", {"lr": 0.02, "momentum": 0.9}, data="digits"),
    "mlp": ModelDefaults("gradsync.train.models:MLP", "sgd", {"lr": 0.02, "momentum": 0.9}, data="digits"),
    "charlm": ModelDefaults("gradsync.train.models:CharLM", "adamw", {"lr": 1e-3, "weight_decay": 0.01},
                            data="stdlib-text", accuracy="next-byte accuracy"),
    # 3,000 steps: about a minute with 3 workers here (one pass over the 1.5M-token corpus is ~26,000)
    "word2vec": ModelDefaults("gradsync.train.word2vec:skip_gram", "adagrad", {"lr": 0.2},
                              loss="gradsync.train.word2vec:negative_sampling_loss", data="stdlib-tokens",
                              steps=3000, after="gradsync.train.word2vec:print_neighbours"),
}
"""The built-in models (--model NAME)."""

DATASETS = {
    "digits": "gradsync.train.datasets:digits",
    "stdlib-text": "gradsync.train.datasets:stdlib_text",
    "synthetic": "gradsync.train.datasets:synthetic",
    "stdlib-tokens": "gradsync.train.tokens:stdlib_tokens",
}
"""The built-in datasets (--data NAME), each a factory returning (train, test)."""

NATURAL_MODEL = {"digits": "cnn", "synthetic": "mlp", "stdlib-text": "charlm", "stdlib-tokens": "word2vec"}
"""--model's default for a built-in dataset given alone."""


def model_defaults(model: str) -> ModelDefaults:
    """The defaults of --model ``model``: a built-in's, or USER_DEFAULTS with its factory."""
    return MODELS[model] if model in MODELS else ModelDefaults(factory=model)


def data_factory(data: str) -> str:
    """The module:function --data ``data`` stands for."""
    return DATASETS.get(data, data)


def resolve(model: str | None, data: str | None) -> tuple[str, str]:
    """(model, data) with the defaults filled in: cnn on digits when neither is given, a built-in's natural
    partner when one is; a user's factory has no partner, so one line says what to add."""
    if model is None and data is None:
        return "cnn", "digits"
    if data is None:
        if model not in MODELS:
            raise ValueError(f"--model {model} needs --data: give the dataset factory too (--data module:function "
                             f"returning (train, test) map-style datasets), or a built-in: {', '.join(DATASETS)}")
        return model, MODELS[model].data
    if model is None:
        if data not in NATURAL_MODEL:
            raise ValueError(f"--data {data} needs --model: give the model factory too (--model module:function), "
                             f"or a built-in: {', '.join(MODELS)}")
        return NATURAL_MODEL[data], data
    return model, data
