"""Bad input in a world of one (this process): each case gives a clear error naming what was wrong.
The catalogue of all cases, with the errors, is docs/reliability.md."""

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.ps.parameter_server import ParameterServer


@pytest.fixture
def world():
    yield gs.init(timeout=5)
    gs.shutdown()


@pytest.fixture
def debug_world():
    yield gs.init(timeout=5, debug=True)
    gs.shutdown()


def test_ddp_of_a_model_without_parameters(world):
    with pytest.raises(ValueError, match="at least one parameter that requires grad"):
        gs.DistributedDataParallel(nn.ReLU())


def test_ddp_of_something_that_is_not_a_module(world):
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        gs.DistributedDataParallel(torch.ones(3))


@pytest.mark.parametrize("kwargs, error, words", [
    ({"device_ids": [0, 1]}, ValueError, "device_ids=[0, 1]: give None or exactly one device, the one the module is on (cpu)"),
    ({"device_ids": [0]}, ValueError, "device_ids=[0] but the module is on cpu; move the module there first"),
    ({"output_device": "cuda:1"}, ValueError, "output_device='cuda:1' but the module is on cpu"),
    ({"device_mesh": object()}, RuntimeError, "device_mesh is not supported by gradsync's wrapper"),
    ({"bucket_view": True}, TypeError, "unexpected keyword arguments bucket_view"),
])
def test_torch_ddp_arguments_gradsync_cannot_honour_are_refused_by_name(world, kwargs, error, words):
    """docs/reliability.md's catalogue #27 (ddp/torch_arguments.py): each one named, with what to do."""
    with pytest.raises(error) as info:
        gs.DistributedDataParallel(nn.Linear(2, 2), **kwargs)
    assert words in str(info.value), str(info.value)


def test_torch_ddp_arguments_that_mean_the_same_here_are_accepted(world):
    model = gs.DistributedDataParallel(nn.Linear(2, 2), device_ids=["cpu"], output_device="cpu", dim=0,
                                       gradient_as_bucket_view=True, static_graph=True, check_reduction=True,
                                       mixed_precision=None)
    model(torch.ones(3, 2)).sum().backward()


def test_nan_gradients_are_caught_in_debug_mode(debug_world):
    model = gs.DistributedDataParallel(nn.Linear(4, 2))
    loss = model(torch.full((3, 4), float("nan"))).sum()
    with pytest.raises(FloatingPointError, match="weight, bias|bias, weight|NaN or Inf"):
        loss.backward()


def test_nan_gradients_pass_silently_without_debug(world):
    model = gs.DistributedDataParallel(nn.Linear(4, 2))
    model(torch.full((3, 4), float("nan"))).sum().backward()   # the check is opt-in: it costs a pass over M


def test_parameter_server_needs_a_worker(world):
    with pytest.raises(ValueError, match="num_servers must be an integer in 1..world_size-1"):
        ParameterServer(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1))


def test_parameter_server_bad_mode_and_staleness(world):
    with pytest.raises(ValueError, match="unknown mode 'eventual'; choose one of sync, async, ssp"):
        ParameterServer(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), mode="eventual")
    with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
        ParameterServer(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), mode="ssp", staleness=-1)


def test_parameter_server_bad_clipping(world):
    for value in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
            ParameterServer(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), max_grad_norm=value)
    for value in (0, -1.0, "fro"):
        with pytest.raises(ValueError, match=r"use a p > 0 \(1.0, 2.0, ...\) or inf"):
            ParameterServer(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), max_grad_norm=1.0, norm_type=value)


def test_sharded_optimizer_refuses_groups_and_non_optimizers(world):
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="not parameter groups"):
        gs.ShardedOptimizer([{"params": list(model.parameters())}], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        gs.ShardedOptimizer(model.parameters(), "adam", lr=0.1)
    with pytest.raises(ValueError, match="non-empty iterable of tensors"):
        gs.ShardedOptimizer([], torch.optim.SGD, lr=0.1)


def test_sharded_optimizer_load_of_a_foreign_state(world):
    opt = gs.ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.Adam, lr=0.1)
    with pytest.raises(ValueError, match="keys 'state' and 'param_groups'"):
        opt.load_state_dict({"weights": 1})
    with pytest.raises(ValueError, match="optimizer state for 3 parameters, this model has 2"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1, 2]}]})


def test_spawn_of_a_lambda_is_refused():
    with pytest.raises(ValueError, match="module-level function"):
        gs.spawn(lambda: 1, nprocs=2)
