"""Shared fixtures: a guard on torch's global hook registries and small seeded models."""

from __future__ import annotations

import copy
import io
import os
import pickle
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir
from torch import nn
from torch.nn import functional as F

from surgery.ops.build.intercept import _registry as intercept_registry
from surgery.testing import assert_no_hooks, global_hook_counts

# Hypothesis: `make test` runs the "ci" profile, the same examples on every run (derandomized; nothing
# written into the checkout); SURGERY_HYPOTHESIS=thorough runs ten times as many, drawn afresh. Tests
# size their examples with support.examples(share of the profile's count).
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SURGERY_HYPOTHESIS", "ci"))
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "surgery-hypothesis"))  # its caches, outside the checkout

pytest_plugins = ["subprocess_budget", "xdist_groups"]  # tests/: child processes counted; xdist groups kept together
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # xdist's workers share the cores: one intra-op thread each
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )  # tests/subprocess_budget.py: the suite's child processes, counted


def global_state() -> dict[str, int]:
    """Sizes of every global registry surgery could leave something in."""
    from torch.optim import optimizer

    return {
        **global_hook_counts(),
        "intercept blocks (all threads)": intercept_registry.count,
        "intercept blocks (this thread)": len(intercept_registry.stack()),
        "optimizer pre hooks": len(optimizer._global_optimizer_pre_hooks),
        "optimizer post hooks": len(optimizer._global_optimizer_post_hooks),
    }


CHECKOUT = Path(__file__).resolve().parents[1]
RUN_OUTPUTS = ("outputs", "multirun", "gpu_check_out", ".hypothesis")  # where a careless test would write


@pytest.fixture(autouse=True, scope="session")
def checkout_untouched() -> Iterator[None]:
    """No test writes a run's outputs into the checkout: each writes under its own tmp_path."""
    before = {name for name in RUN_OUTPUTS if (CHECKOUT / name).exists()}
    yield
    made = sorted(name for name in RUN_OUTPUTS if (CHECKOUT / name).exists() and name not in before)
    assert not made, f"the tests wrote into the checkout: {made}"


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt for the test, whatever an earlier test in this process (or
    the test runner's worker) left as SIGINT's handler; put back afterwards."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Every test starts from the same random state, whichever tests ran before it in its process."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def no_leaked_global_hooks() -> Iterator[None]:
    """Every test leaves torch's global hook registries and surgery's intercept registry exactly
    as it found them."""
    before = global_state()
    yield
    after = global_state()
    leaked = {name: (count, after[name]) for name, count in before.items() if after[name] != count}
    assert not leaked, f"a test leaked global state (before, after): {leaked}"


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


class ConvNet(nn.Module):
    """Conv -> BN -> ReLU -> residual conv -> pool -> Linear head, with non-trivial BN stats."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)
        for bn in (self.bn1, self.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.2, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(x + self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_mlp(seed: int = 0) -> nn.Module:
    """Three Linear layers (named ``0``, ``2``, ``4``) with ReLUs between them."""
    return _seeded(
        lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), seed
    )


def make_convnet(seed: int = 0) -> nn.Module:
    """A small CNN with BatchNorm (random running stats) and a residual connection."""
    return _seeded(ConvNet, seed)


@pytest.fixture
def mlp_factory() -> Callable[..., nn.Module]:
    """Builds a fresh, identically initialised MLP on each call (``seed`` changes the weights)."""
    return make_mlp


@pytest.fixture
def convnet_factory() -> Callable[..., nn.Module]:
    """Builds a fresh, identically initialised ConvNet on each call."""
    return make_convnet


@pytest.fixture
def mlp() -> Iterator[nn.Module]:
    """A seeded MLP; the test must leave no hook on it."""
    model = make_mlp()
    yield model
    assert_no_hooks(model)


@pytest.fixture
def convnet() -> Iterator[nn.Module]:
    """A seeded ConvNet; the test must leave no hook on it."""
    model = make_convnet()
    yield model
    assert_no_hooks(model)


@pytest.fixture
def mlp_input() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def image_input() -> torch.Tensor:
    return torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(2))


def _torch_save_round_trip(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.fixture(
    params=[copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m)), _torch_save_round_trip],
    ids=["deepcopy", "pickle", "torch.save"],
)
def duplicate(request) -> Callable[[nn.Module], nn.Module]:
    """Each way a user copies a model: deepcopy, pickle, torch.save(model)/torch.load."""
    return request.param


@pytest.fixture(scope="session")
def memory_probe():
    """A process that measures memory peaks (tests/memory_probe.py), shared by the tests that
    ask for one; they carry ``xdist_group("memory")``, so one worker starts it."""
    from support import MemoryProbe

    probe = MemoryProbe()
    yield probe
    probe.close()
