"""Task: what a run trains -- a model factory, its data, and how a batch becomes a loss.

    gradsync train --model my_pkg.models:build --model-args depth=4 --data my_pkg.data:build --loss mse

    model    module:function (or a built-in name, train/tasks.py) returning an nn.Module with parameters,
             called with --model-args; every rank calls it after seeding torch with --seed
    data     module:function returning the training set, (train, test), or {"train": ..., "test": ...,
             "collate": fn}: map-style torch Datasets (len() and [i]); called with --data-args, and with
             seed=--seed when it takes a ``seed`` and none was given
    loss     --loss: train/losses.py's conventions

A batch is the samples the step gives this rank, collated as torch's DataLoader does (default_collate,
or the data's own collate); a TensorDataset is sliced directly. A rank that holds no sample of a step
(the epoch's last, shorter step over many ranks) still computes one sample with weight 0, so its
gradient hooks fire and it adds zeros.

The launcher builds the model and the data once and runs one small batch through the loss before any
rank starts (train/runs.py check_task, then ``probe``), so a factory that cannot be imported or returns the wrong kind of thing, an
iterable-style dataset, a batch the loss rejects or a model without parameters is one line naming the
flag, not a traceback from every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

from gradsync.train import factory
from gradsync.train.losses import LossRule, samples_in
from gradsync.train.optimizers import OptimizerSpec, optimizer_spec
from gradsync.train.tasks import ModelDefaults, data_factory, model_defaults


@dataclass
class TaskData:
    """What the data factory gave: the training set, the test set (or None), how samples are collated."""

    train: Dataset
    test: Dataset | None
    collate: Callable = default_collate


class Task:
    """A model, its data and its loss, named as the flags name them (module docstring)."""

    def __init__(self, model: str, data: str, model_args: dict | None = None, data_args: dict | None = None,
                 loss: str | None = None, metric: str | None = None, seed: int = 0) -> None:
        self.model_name, self.data_name, self.seed = model, data, seed
        self.defaults: ModelDefaults = model_defaults(model)
        self.model_args, self.data_args = dict(model_args or {}), dict(data_args or {})
        self._model_factory = factory.load(self.defaults.factory, "--model")
        self._data_factory = factory.load(data_factory(data), "--data")
        self.loss = LossRule(loss if loss is not None else self.defaults.loss, metric)

    @classmethod
    def of(cls, cfg) -> "Task":
        """The task a TrainConfig names."""
        return cls(cfg.model, cfg.dataset, cfg.model_args, cfg.data_args, cfg.loss, cfg.metric, cfg.seed)

    def optimizer(self, cfg) -> OptimizerSpec:
        """The optimizer --optimizer, --lr, --weight-decay and --momentum ask for, over the model's defaults."""
        return optimizer_spec(cfg.optimizer or self.defaults.optimizer, cfg.lr, cfg.weight_decay, cfg.momentum,
                              self.defaults.hyper, self.defaults.optimizer)

    # -- building ----------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        model = factory.call(self._model_factory, self.model_args, "--model", self.model_name)
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {self.model_name} returned an object of type {type(model).__name__}; it must "
                             f"return a torch.nn.Module")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(f"--model {self.model_name} returned a {type(model).__name__} with no trainable "
                             f"parameters: there is nothing to train")
        return model

    def build_data(self) -> TaskData:
        made = factory.call(self._data_factory, self.data_args, "--data", self.data_name, seed=self.seed)
        if isinstance(made, Mapping):
            unknown = set(made) - {"train", "test", "collate"}
            if "train" not in made or unknown:
                raise ValueError(f"--data {self.data_name} returned a dict with keys {sorted(made)}; give 'train' "
                                 f"and optionally 'test' and 'collate'")
            data = TaskData(made["train"], made.get("test"), made.get("collate") or default_collate)
        elif isinstance(made, tuple) and any(isinstance(part, torch.Tensor) for part in made):
            raise ValueError(f"--data {self.data_name} returned a tuple of tensors; wrap them in a dataset: "
                             f"torch.utils.data.TensorDataset(inputs, targets), or return (train, test) datasets")
        elif isinstance(made, tuple) and len(made) == 2:
            data = TaskData(made[0], made[1])
        else:
            data = TaskData(made, None)
        for which, dataset in (("training", data.train), ("test", data.test)):
            if dataset is not None:
                self._check_map_style(which, dataset)
        if len(data.train) == 0:
            raise ValueError(f"--data {self.data_name}: the training set is empty")
        return data

    def _check_map_style(self, which: str, dataset) -> None:
        if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(f"--data {self.data_name}: the {which} set is a {type(dataset).__name__}, not a map-style "
                             f"dataset; gradsync train shards samples by index, so give a torch.utils.data.Dataset "
                             f"with __len__ and __getitem__ (e.g. TensorDataset, or a list of (input, target) pairs)")

    # -- batches -----------------------------------------------------------------------------------
    @staticmethod
    def batch(data: TaskData, dataset, ids: list[int]):
        """The samples ``ids`` of ``dataset``, collated (module docstring)."""
        if isinstance(dataset, TensorDataset):
            index = torch.as_tensor(ids, dtype=torch.int64)
            return tuple(t[index] for t in dataset.tensors)
        getitems = getattr(dataset, "__getitems__", None)
        samples = getitems(list(ids)) if getitems is not None else [dataset[i] for i in ids]
        return data.collate(samples)

    # -- the launcher's check ----------------------------------------------------------------------
    def probe(self, model: nn.Module, data: TaskData) -> None:
        """A batch of two training samples through the loss, and one test sample through the score: a batch the
        loss rejects, or a loss that does not depend on the parameters, is one line naming the flags."""
        for dataset, training in ((data.train, True), (data.test, False)):
            if dataset is None or len(dataset) == 0:
                continue
            batch = self.batch(data, dataset, list(range(min(2 if training else 1, len(dataset)))))
            try:
                loss, outputs = self.loss(model, batch)
                if not training:
                    self.loss.score(outputs, batch)
            except ValueError:
                raise
            except Exception as exc:
                raise ValueError(f"--model {self.model_name} cannot train on --data {self.data_name}: a batch of "
                                 f"{samples_in(batch)} raised {type(exc).__name__} in forward or the loss "
                                 f"(--loss {self.loss.spec}): {exc}") from None
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
                raise ValueError(f"--loss {self.loss.spec}: the loss is not a 0-dim floating-point tensor")
            if training and not loss.requires_grad:
                raise ValueError(f"--model {self.model_name}: the loss does not depend on any trainable parameter "
                                 f"(requires_grad is False)")
