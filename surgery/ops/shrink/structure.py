"""The recorded shrunk structure (what ``rebuild`` reads) as untrusted input: its seal and the checks ``rebuild`` runs.

``ShrinkHandle.structure()`` adds a ``"$model"`` entry holding a fingerprint of the original model
(every module's name and class, every parameter's name and shape) and a digest of the layer
entries. :func:`read_entries` checks a plan's form (known keys, numbers in range, nesting
bounded) and its digest; :func:`check_model` refuses a plan made for another model, and
:func:`check_attributes` lets ``rebuild`` set only the attributes shrink itself changes (norm
widths, attention head counts), as integers no larger than the model's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from torch import nn

from surgery.core.errors import ConfigError, ConfigTypeError, SurgeryError
from surgery.ops.experts.layouts import fused_layout
from surgery.ops.shrink.heads import layout_of

FUSED_WIDTHS = ("intermediate_dim", "intermediate_size")  # a fused experts class's attribute for its width

log = logging.getLogger("surgery")
SEAL = "$model"
ENTRY_KEYS = ("class", "args", "attributes", "parameters", "buffers")
NORM_WIDTH = {"num_features": int, "num_channels": int, "normalized_shape": tuple}
LARGEST = 2**31 - 1  # a width, a kernel size or a head count beyond this is no layer shrink made


class ShrinkError(SurgeryError, RuntimeError):
    """The shrunk model does not run or changed its output shapes (the model was restored)."""


def fingerprint(model: nn.Module) -> str:
    """A digest of the model's structure: modules (name, class) and parameters (name, shape)."""
    modules = [(name, f"{type(m).__module__}.{type(m).__qualname__}") for name, m in model.named_modules()]
    params = [(name, list(p.shape)) for name, p in model.named_parameters()]
    return _digest({"modules": modules, "parameters": params})


def seal(entries: dict[str, dict[str, Any]], model_fingerprint: str) -> dict[str, Any]:
    """``entries`` with the ``"$model"`` seal added (the model's fingerprint, the entries' digest)."""
    return {**entries, SEAL: {"fingerprint": model_fingerprint, "digest": _digest(entries)}}


def read_entries(plan: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The plan's layer entries, checked, and the fingerprint it was sealed with (``None`` for
    an unsealed plan, which is accepted with a warning).

    Raises:
        ConfigError: an entry of the wrong form, a number out of range, or entries that were
            changed after the plan was made.
    """
    entries = {name: entry for name, entry in plan.items() if name != SEAL}
    for name, entry in entries.items():
        _check_entry(name, entry)
    sealed = plan.get(SEAL)
    if sealed is None:
        log.warning(
            "rebuild: the plan carries no %r seal (made before surgery 0.2, or by hand): it cannot be checked "
            "against the model it was made for",
            SEAL,
        )
        return entries, None
    if not isinstance(sealed, dict) or not all(isinstance(sealed.get(k), str) for k in ("fingerprint", "digest")):
        raise ConfigError(
            f"rebuild.plan['{SEAL}']",
            type(sealed).__name__,
            "must be the {'fingerprint', 'digest'} dict ShrinkHandle.structure() writes",
        )
    if _digest(entries) != sealed["digest"]:
        raise ConfigError(
            "rebuild.plan",
            SEAL,
            "the layer entries were changed after the plan was made (their "
            "digest differs); make a new plan with shrink",
        )
    return entries, sealed["fingerprint"]


def check_model(model: nn.Module, expected: str | None, factory: object) -> None:
    """Refuse a plan sealed for another model than the one ``factory`` builds."""
    if expected is not None and fingerprint(model) != expected:
        name = getattr(factory, "__name__", type(factory).__name__)
        raise ConfigError(
            "rebuild.plan",
            SEAL,
            f"was made for another model: {name}() builds a "
            f"{type(model).__name__} whose modules or parameter shapes differ from the shrunk model's",
        )


def check_attributes(name: str, module: nn.Module, attributes: dict[str, Any]) -> None:
    """Only widths and head counts shrink changes, as integers in [1, the module's own value]."""
    layout = layout_of(module)
    allowed = set(NORM_WIDTH) | {"num_groups"} if any(hasattr(module, a) for a in NORM_WIDTH) else set()
    if fused_layout(module) is not None:  # a fused experts module's width (its tensors are planned shapes)
        allowed |= set(FUSED_WIDTHS)
    if layout is not None:
        allowed |= set(layout.heads) | set(layout.derived)
    for attr, value in attributes.items():
        field = f"rebuild.plan['{name}'].attributes.{attr}"
        if attr not in allowed or not hasattr(module, attr):
            raise ConfigError(
                field,
                value,
                f"is not an attribute shrink changes on a {type(module).__name__}"
                f"{'; allowed: ' + ', '.join(sorted(allowed)) if allowed else ' (none are)'}",
            )
        current = getattr(module, attr)
        if isinstance(current, (tuple, list)):
            if (
                not isinstance(value, list)
                or len(value) != len(current)
                or not all(_integer(v) and 1 <= v <= c for v, c in zip(value, current))
            ):
                raise ConfigError(
                    field, value, f"must be a list of {len(current)} integers, each in [1, {list(current)}]"
                )
        elif not _integer(current) or not _integer(value) or not 1 <= value <= current:
            raise ConfigError(field, value, f"must be an integer in [1, {current}] (shrink only removes)")


def _check_entry(name: str, entry: Any) -> None:
    field = f"rebuild.plan['{name}']"
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("class"), str)
        or not any(isinstance(entry.get(key), dict) for key in ENTRY_KEYS[1:])
    ):
        raise ConfigTypeError(
            field,
            type(entry).__name__,
            "must be a {'class', 'args' | 'attributes' | 'parameters'} dict from ShrinkHandle.structure()",
        )
    unknown = set(entry) - set(ENTRY_KEYS)
    if unknown:
        raise ConfigError(field, sorted(unknown)[0], f"is not a plan key; allowed: {', '.join(ENTRY_KEYS)}")
    for key in ENTRY_KEYS[1:]:
        values = entry.get(key, {})
        if not isinstance(values, dict):
            raise ConfigTypeError(f"{field}.{key}", type(values).__name__, "must be a dict")
        for attr, value in values.items():
            if not isinstance(attr, str) or not attr.isidentifier() or attr.startswith("_"):
                raise ConfigError(f"{field}.{key}", attr, "must be a public attribute name")
            if key in ("parameters", "buffers") and not (isinstance(value, list) and all(map(_in_range, value))):
                raise ConfigError(
                    f"{field}.{key}.{attr}", value, f"must be a shape: a list of integers in [0, {LARGEST}]"
                )
            if key in ("args", "attributes") and not _plain_value(value):
                raise ConfigError(
                    f"{field}.{key}.{attr}",
                    value,
                    f"must be a number in [0, {LARGEST}], a string, a bool, null, or a list of such numbers",
                )


def _plain_value(value: Any) -> bool:
    if isinstance(value, list):
        return all(_in_range(v) for v in value)
    if isinstance(value, float):
        return value == value and abs(value) <= LARGEST
    return value is None or isinstance(value, (bool, str)) or _in_range(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value: Any) -> bool:
    return _integer(value) and 0 <= value <= LARGEST


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]
