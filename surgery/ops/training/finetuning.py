"""``surgery.finetune``: train a model with its surgery attached, restorably.

Masks, quantization grids and shadow weights hold through every step (the handles' gradient
and optimizer step hooks do that); this module only runs the loop. The returned handle keeps
a copy of every parameter and buffer as they were before training, so ``restore()`` puts the
model back exactly (then the surgery handles can be restored in turn) and ``bake()`` keeps
the trained values. An interrupted or failing run puts the values back itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core.errors import NO_VALUE, ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.inputs import as_call, device_of, evaluating, moved
from surgery.core.progress import tqdm
from surgery.core.registry import Registry
from surgery.core.settings import whole_count
from surgery.core.verbs import VerbCall, verb
from surgery.ops.quantization.qat import return_loans
from surgery.ops.quantization.quantization import learned_ranges
from surgery.ops.training.distillation import Distillation, DistillSpec, distill_spec, prediction

OptimizerFactory = Callable[..., torch.optim.Optimizer]
EPOCHS_LIMIT = 10_000
STEPS_LIMIT = 10_000_000
LONG_RUN = 3600.0  # seconds: a run estimated longer than this is said before it goes on
log = logging.getLogger("surgery")
OPTIMIZERS: Registry[OptimizerFactory] = Registry("finetune.optimizer")


def _torch_optimizer(cls: type[torch.optim.Optimizer], fused: bool) -> OptimizerFactory:
    def build(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        implementation = {"fused": True} if fused else {"foreach": True}
        return cls(params, lr=lr, weight_decay=weight_decay, **implementation)

    build.__name__ = cls.__name__
    return build


for _name, _cls, _fused in (
    ("adamw", torch.optim.AdamW, True),
    ("adam", torch.optim.Adam, True),
    ("sgd", torch.optim.SGD, True),
    ("adagrad", torch.optim.Adagrad, True),
    ("rmsprop", torch.optim.RMSprop, False),
):  # RMSprop has no fused kernel
    OPTIMIZERS.register(_name, _torch_optimizer(_cls, _fused))


@dataclass
class Point:
    """One point of the training curve: after ``step`` optimizer steps, the mean training loss
    since the previous point and the evaluation score (``None`` without ``evaluate``)."""

    step: int
    loss: float | None
    score: float | None


class FinetuneHandle(Handle):
    """Handle returned by :func:`finetune`: ``restore()`` puts back every parameter and buffer
    as before training, ``bake()`` keeps the trained values; ``curve`` is the training curve."""

    undo_first = True  # the weights it saved hold the earlier handles' changes: undo it before them

    def __init__(self, model: nn.Module) -> None:
        super().__init__("finetune", model)
        self.curve: list[Point] = []
        self.projections = nn.ModuleDict()  # distillation's learned width projections (never in the model)
        self.distilled: list[str] = []  # the feature layers distilled


@dataclass(frozen=True)
class FinetuneSpec:
    """How to fine-tune, validated when built: ``FinetuneSpec(lr=-1)`` raises at once. The
    fields are :func:`finetune`'s settings (see there)."""

    epochs: int = 1
    lr: float = 1e-3
    optimizer: Any = "adamw"  # a registered name, or a factory (params, lr, weight_decay) -> optimizer
    weight_decay: float = 0.0
    eval_every: int | None = None
    seed: int = 0
    distill: DistillSpec | None = None  # learn from a teacher (finetune's teacher=) as well as the task
    max_steps: int | None = None  # stop after this many optimizer steps (None: every batch of every epoch)

    def __post_init__(self) -> None:
        if self.distill is not None:
            object.__setattr__(self, "distill", distill_spec(self.distill))
        epochs, lr, weight_decay, eval_every = self.epochs, self.lr, self.weight_decay, self.eval_every
        whole_count("finetune.epochs", epochs, "epochs", at_least=0, at_most=EPOCHS_LIMIT, example=3)
        for field, value in (("finetune.lr", lr), ("finetune.weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(field, value, "must be a finite number >= 0")
        if eval_every is not None and (
            isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1
        ):
            raise ConfigError("finetune.eval_every", eval_every, "must be null or an integer >= 1")
        steps = self.max_steps
        if steps is not None:
            whole_count("finetune.max_steps", steps, "steps (or null)", at_most=STEPS_LIMIT, example=1000)
        if not callable(self.optimizer):
            OPTIMIZERS.get(self.optimizer)

    @property
    def make_optimizer(self) -> OptimizerFactory:
        return self.optimizer if callable(self.optimizer) else OPTIMIZERS.get(self.optimizer)


@verb(
    "finetune",
    FinetuneSpec,
    calibration="required",
    extras={"loss": None, "evaluate": None, "teacher": None},
    renamed={"batches": "calibration"},
    old_positional=("calibration", "spec"),
    unwrap_compiled=False,
)
def finetune(model: nn.Module, spec: FinetuneSpec, call: VerbCall) -> FinetuneHandle:
    """Train ``model`` on ``(inputs, target)`` batches with whatever surgery is attached to it.

    Args:
        spec: a :class:`FinetuneSpec` holding the settings below (the keywords are a shorthand for it).
        calibration: the training batches, a sequence of ``(inputs, target)`` pairs; ``inputs``
            is a tensor, a tuple of positional inputs or a dict of keyword inputs. Their order is
            shuffled every epoch (seeded by ``seed``). Before 0.3 the second positional argument
            (or ``batches=``).
        epochs: passes over ``batches``.
        lr, weight_decay: the optimizer's settings.
        optimizer: ``"adamw"`` (default, fused), ``"adam"``, ``"sgd"``, ``"adagrad"`` (fused),
            ``"rmsprop"`` (foreach), a name registered in ``OPTIMIZERS``, or a function
            ``(params, lr, weight_decay) -> torch.optim.Optimizer``.
        loss: ``loss(output, target) -> scalar``; default :func:`logits_cross_entropy` (the
            output's ``.logits`` taken, a language model's per token against aligned targets).
        evaluate: ``evaluate(model) -> float`` (accuracy, say), recorded in :attr:`FinetuneHandle.curve`
            before the first step, every ``eval_every`` steps (default: each epoch) and at the end.
        teacher: the uncompressed model to distil from (see :mod:`surgery.ops.training.distillation`):
            only read, in eval mode, without gradients.
        max_steps: stop after this many optimizer steps (default: every batch of every epoch).
        distill: a :class:`DistillSpec` (or a dict of its fields): the logits' temperature and
            weight against the task loss, the feature layers and their weight, and what to do
            where ``shrink`` made a layer narrower. Default with a teacher: logits only,
            temperature 2, weight 0.5.
        progress: a progress bar over steps (on a terminal).

    Example:
        >>> pruned = surgery.prune(model, 0.9)
        >>> tuned = surgery.finetune(model, calibration=train_batches, epochs=5, evaluate=accuracy_on_test)
        >>> tuned.curve[0].score, tuned.curve[-1].score   # after pruning, after fine-tuning
    """
    batches, progress = call.calibration, call.progress
    loss, evaluate, teacher = call.extras["loss"], call.extras["evaluate"], call.extras["teacher"]
    epochs, lr, weight_decay, eval_every, seed = spec.epochs, spec.lr, spec.weight_decay, spec.eval_every, spec.seed
    _validate(batches)
    if spec.distill is not None and teacher is None:
        raise ConfigError(
            "finetune.teacher", NO_VALUE, "distillation learns from the uncompressed model: pass teacher="
        )
    distillation = None if teacher is None else Distillation(model, teacher, spec.distill or DistillSpec())
    make_optimizer = spec.make_optimizer
    handle = FinetuneHandle(model)
    saved = {name: t.detach().clone() for name, t in _state(model).items()}
    ranges = learned_ranges(model)  # activation ranges that quantization-aware training moves
    model_ref = weakref.ref(model)
    handle.add(
        "undo fine-tuning (every parameter, buffer and learned range as before)",
        lambda: _put_back(model_ref(), saved, ranges),
    )
    flags = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        with distillation or contextlib.nullcontext():
            extra = (
                [] if distillation is None else distillation.prepare(as_call(batches[0][0], "finetune.calibration", 0))
            )
            if distillation is not None:
                handle.projections, handle.distilled = distillation.projections, distillation.layers
            loss = logits_cross_entropy if loss is None else loss
            objective = _task(loss) if distillation is None else _distilling(loss, distillation)
            _train(
                model,
                handle,
                batches,
                epochs,
                make_optimizer([*(p for p in model.parameters() if p.requires_grad), *extra], lr, weight_decay),
                objective,
                evaluate,
                eval_every or len(batches),
                seed,
                progress,
                spec.max_steps,
            )
        _check_finite(model, batches[0], loss, lr)
    except BaseException as err:  # interrupted or failed: the model as it was before training
        return_loans(model)  # a forward cut short may have left a quantized weight in its slot
        handle.rollback(err)
        raise
    finally:
        for module, flag in flags:
            module.training = flag
        for param, grad in grads:  # the loop's gradients are not the caller's
            param.grad = grad
    return handle


def _distilling(loss: Callable, distillation: Distillation) -> Callable:
    """``loss(output, target, call)``: the task loss mixed with the distillation's."""

    def objective(output: Any, target: Any, call: Any) -> Tensor:
        return distillation.loss(output, target, call, loss(output, target))

    return objective


def logits_cross_entropy(output: Any, target: Tensor) -> Tensor:
    """Cross-entropy of an output's logits (the tensor, ``.logits``, ``["logits"]`` or a tuple's
    first) against ``target``; sequence logits ``(batch, tokens, classes)`` per token, against
    ``(batch, tokens)`` targets (a causal LM's: the next tokens)."""
    try:
        _, logits = prediction(output)
    except ConfigTypeError:
        raise ConfigTypeError(
            "finetune.loss", type(output).__name__, "gives no tensor or .logits for cross-entropy; pass loss="
        ) from None
    if logits.dim() > 2 and target.dim() == logits.dim() - 1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return F.cross_entropy(logits, target)


def _task(loss: Callable) -> Callable:
    """``loss(output, target, call)``: the task loss alone."""
    return lambda output, target, call: loss(output, target)


def _train(
    model: nn.Module,
    handle: FinetuneHandle,
    batches: Sequence,
    epochs: int,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable,
    evaluate: Callable | None,
    eval_every: int,
    seed: int,
    progress: bool,
    max_steps: int | None = None,
) -> None:
    total = epochs * len(batches) if max_steps is None else min(epochs * len(batches), max_steps)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []

    def record(step: int) -> None:
        score = float(evaluate(model)) if evaluate is not None else None
        handle.curve.append(Point(step, sum(losses) / len(losses) if losses else None, score))
        losses.clear()

    record(0)
    step = 0
    started = time.perf_counter()
    with tqdm(total=total, desc="finetune", unit="step", leave=False, disable=None if progress else True) as bar:
        for _ in range(epochs):
            for index in torch.randperm(len(batches), generator=generator).tolist():
                inputs, target = _pair(batches[index], index)
                target = moved(target, device_of(model))  # the inputs are moved by the call
                model.train()
                optimizer.zero_grad(set_to_none=True)
                call = as_call(inputs, "finetune.calibration", index)
                output = call(model)
                try:
                    value = loss_fn(output, target, call)
                except (IndexError, RuntimeError, ValueError) as err:  # targets the loss cannot take
                    first = " ".join(str(err).split())[:160]
                    raise ConfigError(
                        "finetune.calibration",
                        f"batch {index}",
                        f"the loss cannot take this batch's "
                        f"targets ({type(err).__name__}: {first}); with the default cross-entropy, "
                        "targets are integer class indices below the number of classes",
                    ) from None
                if not torch.isfinite(value):
                    raise ConfigError(
                        "finetune.lr",
                        optimizer.param_groups[0]["lr"],
                        f"the loss became {value.item()} "
                        f"at step {step}; lower the learning rate (the model was put back as before)",
                    )
                value.backward()
                optimizer.step()
                step += 1
                if step == 1:
                    _say_how_long(time.perf_counter() - started, total)
                losses.append(value.item())
                bar.update()
                bar.set_postfix(loss=f"{value.item():.4f}")
                if step % eval_every == 0 or step == total:
                    record(step)
                if step == total:
                    return


def _say_how_long(first: float, total: int) -> None:
    """Warn, after the first step, when ``total`` steps at its pace would take longer than :data:`LONG_RUN`."""
    if first * total > LONG_RUN:
        log.warning(
            "finetune: %d steps will take about %.1f hours at the first step's pace (%.2f s); "
            "lower epochs or set max_steps for a shorter run",
            total,
            first * total / 3600,
            first,
        )


def _pair(batch: Any, index: int) -> tuple[Any, Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigTypeError("finetune.calibration", f"batch {index}", "must be an (inputs, target) pair")
    return batch[0], batch[1]


def _check_finite(model: nn.Module, batch: tuple, loss_fn: Callable, lr: float) -> None:
    """The last step can diverge too: a weight that became NaN or Inf, or a loss on the first
    batch that did (one more forward, in eval mode), fails the run."""
    broken = next((name for name, p in model.named_parameters() if not torch.isfinite(p.detach()).all()), None)
    if broken is None:
        with evaluating(model), torch.no_grad():
            value = loss_fn(as_call(batch[0], "finetune.calibration", 0)(model), moved(batch[1], device_of(model)))
        broken = None if torch.isfinite(value).all() else "the loss"
    if broken is not None:
        raise ConfigError(
            "finetune.lr",
            lr,
            f"{broken} became NaN or Inf in training; lower the learning rate (the model was put back as before)",
        )


def _validate(batches: Any) -> None:
    if not isinstance(batches, Sequence) or not len(batches):
        raise ConfigTypeError(
            "finetune.calibration", type(batches).__name__, "must be a non-empty sequence of (inputs, target) pairs"
        )
    first = batches[0]
    if not (isinstance(first, (tuple, list)) and len(first) == 2):
        raise ConfigTypeError(
            "finetune.calibration", type(first).__name__, "each batch must be an (inputs, target) pair"
        )
    for index, batch in enumerate(batches):
        _pair(batch, index)


def _state(model: nn.Module) -> dict[str, Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    return named | {f"buffer:{n}": b for n, b in model.named_buffers(remove_duplicate=False) if b is not None}


def _put_back(model: nn.Module | None, saved: dict[str, Tensor], ranges: list) -> None:
    if model is None:
        return
    return_loans(model)
    with torch.no_grad():
        for name, tensor in _state(model).items():
            tensor.copy_(saved[name])
    for quantizer, state in ranges:
        quantizer.load_range(state)
