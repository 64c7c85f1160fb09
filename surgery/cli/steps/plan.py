"""The ``plan`` step: :func:`surgery.plan` under a recipe's ``plan:`` settings (one budget, a
choice per layer), the plan written as ``plan.json`` in the run's folder and applied."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from surgery.cli.fields import positive_int
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step, target_rows
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.checkpoints import write_atomically
from surgery.core.handles import Handle, HandleGroup, restored_on_error
from surgery.ops.planning.budget import budget_bytes
from surgery.ops.planning.choices import choice_named
from surgery.ops.planning.gguf_mixes import GGUF_MIXES, gguf_mix, type_name
from surgery.ops.planning.planning import DEFAULT_CHOICES, plan
from surgery.ops.quantization.qparams import load_qparams
from surgery.ops.sparsity.pruning import prune_targets

PLAN = "plan.json"
CHOICE_KEY = ".kv_cache_choice"  # of saved activation parameters: the KV-cache choice of an attention module


@dataclass(frozen=True)
class PlanConfig:
    """``plan:``: the arguments of :func:`surgery.plan`; ``budget`` as bytes (``12MB``) or bits
    per weight (``4.5bpw``), a recipe's top-level ``budget`` by default; ``kv_tokens`` the tokens
    a deployment caches when ``choices`` hold KV-cache dtypes (``kv16``, ``kv_int8``...)."""

    budget: Any = None
    choices: list[str] = field(default_factory=lambda: list(DEFAULT_CHOICES))
    select: Any = None
    exclude: Any = None
    method: str = "rtn"
    estimate: str = "auto"  # auto (gradient on a causal LM's next-token loss, else drift) | gradient | drift
    calibration_batches: int = 4
    kv_tokens: int | None = None
    mix: str | None = None  # a llama.cpp file type (Q4_K_M, Q5_K_M): its rules choose, no budget or scores

    def __post_init__(self) -> None:
        if self.mix is not None:
            type_name(self.mix, "plan.mix", list(GGUF_MIXES))
        if self.budget is not None:  # the form only: what it reaches is known once the model is built
            budget_bytes(self.budget, 1)
        for name in self.choices:
            choice_named(name)
        positive_int("plan.calibration_batches", self.calibration_batches)
        if self.kv_tokens is not None:
            positive_int("plan.kv_tokens", self.kv_tokens)


def next_token_loss(output: Any, ids: Tensor) -> Tensor:
    """Mean cross-entropy of each position's logits against the next input token."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class PlanReport(StepReport):
    """What the ``plan`` step reports."""

    outputs = (PLAN,)

    def report(self, handle: Handle, settings: PlanConfig, run: StepRun, report: dict[str, Any]) -> None:
        """``report.json`` ``plan``: the totals and how many layers take each choice."""
        chosen = handle.result
        report["plan"] = {
            "file": PLAN,
            "budget_bytes": chosen.budget,
            "bytes": chosen.total_bytes,
            "bits_per_weight": chosen.bits_per_weight,
            "kv_cache_bytes": chosen.kv_cache_bytes,
            "kv_tokens": chosen.kv_tokens,
            "estimate": chosen.estimate,
            "solver": chosen.solver,
            "counts": chosen.counts(),
        }

    def summary(self, report: dict[str, Any]) -> list[str]:
        """The plan's bits per weight and its choices."""
        found = report.get("plan")
        if found is None:
            return []
        counts = ", ".join(f"{name} x{n}" for name, n in found["counts"].items())
        return [
            f"plan: {found['bits_per_weight']:.3f} bits per weight ({found['bytes']:,} of {found['budget_bytes']:,} "
            f"bytes{_cache(found)}; {found['estimate']} scores, {found['solver']} solve): {counts}"
        ]


class PlanChecks(StepChecks):
    """How the ``plan`` step answers the dry run and the checks."""

    def activation_qparams(self, handle: Handle) -> dict[str, Tensor]:
        """The KV-cache choices' scales, and which choice each attention module took (its name
        as bytes under ``"<attention>.kv_cache_choice"``), for :meth:`reattach`."""
        found: dict[str, Tensor] = {}
        for part in getattr(handle, "handles", []):
            if part.kind == "kv_cache":
                found.update(part.qparams())
        for row in handle.result.rows:
            if row.target == "kv_cache" and choice_named(row.choice).reattach is not None:
                found[f"{row.layer}{CHOICE_KEY}"] = torch.tensor(list(row.choice.encode()), dtype=torch.uint8)
        return found

    def reattach(self, model: nn.Module, settings: PlanConfig, qparams: dict[str, Tensor] | Path) -> Handle | None:
        """Each attention module's KV-cache rounding, from the saved scales (baking folds the
        weight choices; a cache's rounding stays a hook)."""
        if isinstance(qparams, (str, Path)) and not Path(qparams).exists():
            return None  # no step saved activation parameters: the plan chose no KV-cache rounding
        saved = load_qparams(qparams) if isinstance(qparams, (str, Path)) else qparams
        by_choice: dict[str, list[str]] = {}
        for key, value in saved.items():
            if key.endswith(CHOICE_KEY):
                name = bytes(value.tolist()).decode()
                by_choice.setdefault(name, []).append(key.removesuffix(CHOICE_KEY))
        handles = []
        with restored_on_error():
            for name, attention in by_choice.items():
                handles.append(choice_named(name, "plan.layers.choice").reattach(model, attention, saved))
        return HandleGroup(handles, model) if handles else None

    def preview(self, model: nn.Module, settings: PlanConfig) -> list[Row]:
        return target_rows("plan", prune_targets(model, settings.select, settings.exclude), {}, "")


class PlanStep(Step):
    """A choice per layer within the budget, applied with one verb call per choice."""

    name, settings = "plan", PlanConfig
    reporting = PlanReport()
    checking = PlanChecks()

    def apply(self, model: nn.Module, settings: PlanConfig, run: StepRun) -> Handle:
        causal = getattr(run.config.model, "task", None) == "causal_lm" and settings.estimate != "drift"
        calibration = [(x, x) for x in run.calibration] if causal else run.calibration
        if settings.mix is not None:  # llama.cpp's rules choose: no budget, no scores
            chosen = gguf_mix(
                model, settings.mix, method=settings.method, select=settings.select, exclude=settings.exclude or None
            )
        else:
            chosen = self._searched(model, settings, calibration, causal)
        write_atomically(run.folder / PLAN, lambda tmp: chosen.save(tmp, overwrite=True))
        handle = chosen.apply(model, calibration=list(run.calibration))
        handle.result = chosen
        return handle

    @staticmethod
    def _searched(model: nn.Module, settings: PlanConfig, calibration: Any, causal: bool) -> Any:
        return plan(
            model,
            settings.budget,
            settings.choices,
            calibration=calibration,
            loss=next_token_loss if causal else None,
            estimate=settings.estimate,
            method=settings.method,
            select=settings.select,
            exclude=settings.exclude or None,
            kv_tokens=settings.kv_tokens,
        )

    def calibration(self, settings: PlanConfig) -> Calibration | None:
        return Calibration(settings.calibration_batches, field="plan")


def _cache(found: dict[str, Any]) -> str:
    """Of a plan's summary line: the KV cache's share of the bytes, when it planned one."""
    tokens = found.get("kv_tokens")
    return f", {found['kv_cache_bytes']:,} of them KV cache at {tokens:,} tokens" if tokens else ""


register_step(PlanStep())
