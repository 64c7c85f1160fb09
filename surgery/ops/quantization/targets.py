"""Deploy targets: how ``quantize(..., target=NAME)`` simulates what a runtime computes. An
export format registers its target here (``register_export_format(..., target=)``), so the
quantization verb reads the rules without importing export."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from surgery.core.errors import ConfigError
from surgery.core.registry import Registry


@dataclass(frozen=True)
class DeployTarget:
    """How ``quantize(..., target=FORMAT)`` simulates what that format's runtime computes:
    BatchNorm folded first (``fold_batchnorm``), only ``layers`` of these types quantized,
    activations at their ``where``, and the GridSpec fields its kernels fix (``weights``,
    ``activations``: field -> value); ``check`` refuses, before any calibration, a model, a
    setting or a layer the format cannot hold (the export would refuse it after the work)."""

    fold_batchnorm: bool = False
    layers: Any = (nn.Linear,)  # a selection (layer types, or a predicate(module, name))
    where: str = "input"
    weights: dict[str, Any] = field(default_factory=dict)
    activations: dict[str, Any] = field(default_factory=dict)
    # check(model, spec, {name: Target}): raises, when quantize starts, what the format cannot hold
    check: Callable[[nn.Module, Any, dict[str, Any]], None] | None = None


DEPLOY_TARGETS: Registry[DeployTarget] = Registry("quantize.target", table=True)  # filled as formats register


def deploy_target(name: str) -> DeployTarget:
    """The simulation rules of the deployment format ``name`` (``quantize.target``)."""
    if name not in DEPLOY_TARGETS:
        raise ConfigError(
            "quantize.target", name, f"has no deployment rules; one of {', '.join(sorted(DEPLOY_TARGETS))}"
        )
    return DEPLOY_TARGETS.get(name)
