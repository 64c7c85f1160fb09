"""The ``deploy`` round trip: an exported artifact, reloaded in its own runtime, against the model
under surgery (outputs) and the fp32 model (size, latency, the task's metric)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.core.inputs import Call, as_call, device_of, flatten_tensors, moved
from surgery.ops.export.format_table import EXPORT_FORMATS
from surgery.ops.export.parity import ExportRecord


class Deployed(nn.Module):
    """A loaded artifact seen as a module: ``forward`` runs it in its runtime and returns its
    first floating output (the logits), so the task's metric evaluates it as it evaluates the model."""

    def __init__(self, record: ExportRecord, deployable: Any = None) -> None:
        super().__init__()
        self.record = record
        self.deployable = record.load() if deployable is None else deployable
        self.run_one = EXPORT_FORMATS.get(record.format).run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The artifact's first floating output on ``args``, each run where the artifact runs
        (its runtime's device) and given back on the device the inputs came on."""
        call = Call(args, kwargs)
        inputs = flatten_tensors([list(args), dict(kwargs)], floating_only=False)  # token ids too, nested ones
        outputs = self.run_one(self.deployable, moved(call, device_of(self.deployable)))
        found = next((t for t in outputs if t.is_floating_point()), outputs[0])
        return found.to(inputs[0].device) if inputs else found


def fp32_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers stored as float32 (shared tensors once)."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.shape, tensor.stride()) if tensor.numel() else id(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * (4 if tensor.is_floating_point() else tensor.element_size())
    return total


def latency_ratio(reference: nn.Module, deployed: Deployed, batch: Any, rounds: int = 5) -> float:
    """Median over paired, interleaved rounds of (deployed time / reference time) on one batch,
    after one warm-up call of each."""
    call = as_call(batch)
    with torch.no_grad():
        call(reference)
        deployed.run_one(deployed.deployable, call)
        ratios = []
        for _ in range(rounds):
            start = time.perf_counter()
            call(reference)
            middle = time.perf_counter()
            deployed.run_one(deployed.deployable, call)
            ratios.append((time.perf_counter() - middle) / max(middle - start, 1e-9))
    return statistics.median(ratios)


def deploy_summary(
    record: ExportRecord,
    reference: nn.Module,
    inputs: list,
    metric: tuple[str, Callable[[nn.Module], float], bool] | None = None,
) -> dict[str, Any]:
    """``report.json`` ``deploy``: format, path, bytes (and against fp32), latency against the
    fp32 model, the parity figures, the task's metric on the reloaded artifact, and the figures
    of each runtime the format is also made for (``ExportFormat.also_runs_in``: GGUF's llama.cpp)
    against the reloaded artifact, which computes the simulation's outputs."""
    deployed = Deployed(record)
    found: dict[str, Any] = {
        "format": record.format,
        "path": record.path.name,
        "bytes": record.bytes,
        "bytes_vs_fp32": record.bytes / max(fp32_bytes(reference), 1),
        "latency_vs_fp32": latency_ratio(reference, deployed, inputs[0]) if inputs else None,
    }
    if record.parity is not None:
        found |= {
            "cosine": record.parity.cosine,
            "max_abs": record.parity.max_abs,
            "expected": record.parity.expected,
        }
    if metric is not None:
        name, evaluate, _ = metric
        found[name] = evaluate(deployed)
    for runtime, summary in EXPORT_FORMATS.get(record.format).also_runs_in:
        found[runtime] = summary(record.path, deployed, inputs, metric)
    return found
