"""Knowledge distillation for :func:`surgery.finetune`: the compressed model (the student) learns
from the uncompressed one (the teacher) on the same batches.

- **Logits** (Hinton et al. 2015): ``T² · KL(softmax(teacher / T) ‖ softmax(student / T))`` over
  the last axis (per token for sequence logits), mixed with the task loss as
  ``(1 − weight) · task + weight · distillation``.
- **Features**: the mean squared error between the outputs of the layers ``features`` selects,
  caught in both models by :class:`~surgery.core.capture.Capture`'s forward hooks. The teacher's
  are kept for the current batch only (no gradient); the student's keep theirs.

A layer ``shrink`` made narrower than the teacher's (fewer channels) gets a learned linear
projection from the student's width to the teacher's (``widths="project"``, the default),
trained with the model and never part of it: ``bake()`` drops it. ``widths="match"`` matches
only layers whose widths agree and leaves the others out (logged). The teacher is only read:
it runs in eval mode without gradients, and keeps its values, flags and hooks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core.capture import Capture, feature_axis
from surgery.core.errors import ConfigError, ConfigTypeError, first_line
from surgery.core.inputs import Call, evaluating
from surgery.core.selection import Selection
from surgery.core.selection import select as select_modules
from surgery.core.settings import settings_from

log = logging.getLogger("surgery")
WIDTHS = ("project", "match")


@dataclass(frozen=True)
class DistillSpec:
    """How :func:`surgery.finetune` distils from its ``teacher``: the logits' ``temperature`` and
    ``weight`` (of the distillation loss against the task loss, in [0, 1]), the ``features``
    layers (a selection; None: logits only) and their ``feature_weight``, and ``widths``:
    ``"project"`` (a learned projection where widths differ) or ``"match"`` (those layers left
    out)."""

    temperature: float = 2.0
    weight: float = 0.5
    features: Any = None  # a selection (see surgery.select) of layers matched by name in both models
    feature_weight: float = 1.0
    widths: str = "project"

    def __post_init__(self) -> None:
        checks = (
            ("temperature", self.temperature, lambda v: v > 0, "a number > 0"),
            ("weight", self.weight, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            ("feature_weight", self.feature_weight, lambda v: v >= 0, "a number >= 0"),
        )
        for name, value, good, allowed in checks:
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or not good(value):
                raise ConfigError(f"finetune.distill.{name}", value, f"must be {allowed}")
        if self.widths not in WIDTHS:
            raise ConfigError("finetune.distill.widths", self.widths, f"must be one of {', '.join(WIDTHS)}")


def distill_spec(value: Any) -> DistillSpec:
    """A :class:`DistillSpec` from one, a dict of its fields, or None (the defaults)."""
    return DistillSpec() if value is None else settings_from(DistillSpec, value, "finetune.distill")


def prediction(output: Any) -> tuple[str, Tensor]:
    """An output's prediction and its name: the tensor, ``.logits`` / ``["logits"]``, or the first
    element of a tuple."""
    if isinstance(output, Tensor):
        return "output", output
    if isinstance(getattr(output, "logits", None), Tensor):
        return "logits", output.logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), Tensor):
        return "logits", output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return "output[0]", output[0]
    raise ConfigTypeError("finetune.teacher", type(output).__name__, "gives no tensor or .logits to distil from")


class _Latest:
    """A capture reducer holding the latest tensor a layer gave, with its graph (the student's
    features take gradients through it)."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.module, self.tensor = module, None
        self.calls = 0  # every call so far (Distillation.prepare counts those of one forward)

    def update(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self.calls += 1

    def result(self) -> Tensor | None:
        return self.tensor


class Distillation:
    """The distillation loss of one :func:`surgery.finetune` run. Enter it around the training
    loop: the feature hooks go on both models and leave on exit (also on errors)."""

    def __init__(self, student: nn.Module, teacher: nn.Module, spec: DistillSpec) -> None:
        _check_teacher(student, teacher)
        self.student, self.teacher, self.spec = student, teacher, spec
        self.layers = _feature_layers(student, teacher, spec.features)
        self.projections = nn.ModuleDict()  # student width -> teacher width, by layer ("." as "/")
        self._by_layer: dict[str, nn.Linear] = {}
        self.skipped: list[str] = []  # layers left out (widths="match")
        self._captures = (
            Capture(student, {n: student.get_submodule(n) for n in self.layers}, ("outputs",), _Latest),
            Capture(teacher, {n: teacher.get_submodule(n) for n in self.layers}, ("outputs",), _Latest),
        )

    def __enter__(self) -> Distillation:
        for capture in self._captures:
            capture.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for capture in reversed(self._captures):
            capture.close()

    def prepare(self, call: Call) -> list[nn.Parameter]:
        """Check the two models against each other on a first batch (their predictions, each
        feature layer's shape) and build the projections; returns their parameters, for the
        optimizer."""
        with torch.no_grad(), evaluating(self.student), evaluating(self.teacher):
            student_out, teacher_out = call(self.student), _first_output(self.teacher, self.student, call)
        _check_predictions(prediction(student_out), prediction(teacher_out))
        if self.spec.weight:
            _check_classes(*prediction(student_out), self.spec.weight)
        seen = (self._captures[0].outputs, self._captures[1].outputs)
        for name in self.layers:
            ours, theirs = seen[0].get(name), seen[1].get(name)
            if ours is None or theirs is None:
                raise ConfigError(
                    "finetune.distill.features",
                    name,
                    "did not run in a forward of the first batch; select another layer",
                )
            calls = self._captures[0].reducers["outputs"][name].calls
            if calls > 1:
                raise ConfigError(
                    "finetune.distill.features",
                    name,
                    f"ran {calls} times in one forward (a shared module): pick a layer that runs once",
                )
            self._pair(name, ours, theirs)
        return list(self.projections.parameters())

    def _pair(self, name: str, ours: Tensor, theirs: Tensor) -> None:
        axis = feature_axis(self.student.get_submodule(name), ours)
        if ours.shape == theirs.shape:
            return
        same_rest = ours.dim() == theirs.dim() and all(
            a == b for i, (a, b) in enumerate(zip(ours.shape, theirs.shape)) if i != axis
        )
        if not same_rest:
            raise ConfigError(
                "finetune.distill.features",
                name,
                f"gives {tuple(ours.shape)} in the student and {tuple(theirs.shape)} in the teacher; "
                "only the feature axis may differ",
            )
        if self.spec.widths == "match":
            self.skipped.append(name)
            log.info("finetune: %s left out of feature distillation (%d against %d features)", name, ours.shape[axis],
                     theirs.shape[axis])  # fmt: skip
            return
        projection = nn.Linear(ours.shape[axis], theirs.shape[axis], bias=False).to(ours.device, ours.dtype)
        with torch.no_grad():  # start from keeping the channels both have, in order
            projection.weight.zero_()
            kept = min(ours.shape[axis], theirs.shape[axis])
            projection.weight[:kept, :kept] = torch.eye(kept)
        self.projections[name.replace(".", "/")] = self._by_layer[name] = projection

    def loss(self, output: Any, target: Any, call: Call, task: Tensor) -> Tensor:
        """The run's loss for one batch: the task loss mixed with the logits' distillation, plus
        the features' (the teacher runs now, on the same inputs)."""
        with torch.no_grad(), evaluating(self.teacher):
            teacher_out = call(self.teacher)
        spec = self.spec
        _, student = prediction(output)
        _, teacher = prediction(teacher_out)
        t = spec.temperature
        logits = F.kl_div(
            F.log_softmax(student.reshape(-1, student.shape[-1]).float() / t, dim=-1),
            F.log_softmax(teacher.reshape(-1, teacher.shape[-1]).float() / t, dim=-1),
            log_target=True,
            reduction="batchmean",
        )
        total = (1 - spec.weight) * task + spec.weight * t * t * logits
        if self.layers and spec.feature_weight:
            total = total + spec.feature_weight * self._features()
        return total

    def _features(self) -> Tensor:
        ours, theirs = self._captures[0].outputs, self._captures[1].outputs
        losses = []
        for name in self.layers:
            if name in self.skipped:
                continue
            student, teacher = ours[name], theirs[name]
            projection = self._by_layer.get(name)
            if projection is not None:
                axis = feature_axis(self.student.get_submodule(name), student)
                student = projection(student.movedim(axis, -1)).movedim(-1, axis)
            losses.append(F.mse_loss(student.float(), teacher.detach().float()))
        return torch.stack(losses).mean() if losses else torch.zeros(())


def _first_output(teacher: nn.Module, student: nn.Module, call: Call) -> Any:
    """The teacher's output on the first batch; a teacher that fails on it (in another dtype,
    say) is one line naming it."""
    try:
        return call(teacher)
    except Exception as err:
        ours, theirs = _float_dtype(student), _float_dtype(teacher)
        hint = f"; it is {theirs} and the model being trained {ours}: pass teacher.to({ours})" if ours != theirs else ""
        raise ConfigError(
            "finetune.teacher", type(teacher).__name__, f"fails on the first training batch ({first_line(err)}){hint}"
        ) from None


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of a model's first floating parameter."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _check_teacher(student: nn.Module, teacher: Any) -> None:
    if not isinstance(teacher, nn.Module):
        raise ConfigTypeError(
            "finetune.teacher", type(teacher).__name__, "must be an nn.Module (the uncompressed model)"
        )
    if teacher is student:
        raise ConfigError(
            "finetune.teacher",
            type(teacher).__name__,
            "is the model being trained; pass a copy made before compressing it",
        )
    shared = {id(p) for p in student.parameters()} & {id(p) for p in teacher.parameters()}
    if shared:
        raise ConfigError(
            "finetune.teacher",
            type(teacher).__name__,
            f"shares {len(shared)} parameter(s) with the model being trained; pass a copy (copy.deepcopy) "
            "made before compressing it",
        )


def _feature_layers(student: nn.Module, teacher: nn.Module, features: Selection) -> list[str]:
    if features is None:
        return []
    chosen = select_modules(student, features, field="finetune.distill.features")
    names = dict(teacher.named_modules())
    missing = [name for name in chosen if name not in names]
    if missing:
        raise ConfigError(
            "finetune.distill.features",
            missing[0],
            f"is in the student but not in the teacher ({type(teacher).__name__}); features are matched by name",
        )
    return list(chosen)


def _check_classes(name: str, logits: Tensor, weight: float) -> None:
    """Refuse logits without two or more classes on the last axis: KL over one class is 0."""
    if logits.dim() < 2 or logits.shape[-1] < 2:
        raise ConfigError(
            "finetune.distill.weight",
            weight,
            f"distils the {name}, of shape {tuple(logits.shape)}: it needs 2 or more classes on its last axis "
            "(KL over one class is 0, and nothing would be learned); set weight=0 to distil features only",
        )


def _check_predictions(ours: tuple[str, Tensor], theirs: tuple[str, Tensor]) -> None:
    (name, student), (teacher_name, teacher) = ours, theirs
    if name != teacher_name or student.shape != teacher.shape:
        raise ConfigError(
            "finetune.teacher",
            teacher_name,
            f"its {teacher_name} has shape {tuple(teacher.shape)} where the student's {name} has "
            f"{tuple(student.shape)}; the teacher must predict what the student predicts",
        )
