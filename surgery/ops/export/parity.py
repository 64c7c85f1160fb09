"""Parity: how close an export, run in its own runtime, comes to the model under surgery (bit for bit, or a cosine bound)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import replace as replace_field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError, SurgeryError, first_line
from surgery.core.inputs import Call, as_call, device_of, flatten_tensors, moved
from surgery.core.routing import routed_as
from surgery.ops.export.format_table import EXPORT_FORMATS, ExportFormat
from surgery.ops.export.positions import unreached


@dataclass(frozen=True)
class Parity:
    """The loaded artifact against the model under surgery on the same batches, every output
    tensor of both compared: the largest absolute difference and the smallest cosine similarity
    of the floating ones (1.0 when there is none), the smallest share of equal entries of the
    integer and boolean ones (``agreement``; ``None`` when there is none), whether every output
    is equal bit for bit, and which side gave NaN or Inf (``nonfinite``: then ``max_abs`` is
    inf, ``cosine`` NaN and the promise fails). ``expected`` is what the format promises
    (``"exact"`` or a cosine), ``agreement_bound`` what its integer outputs must reach."""

    max_abs: float
    cosine: float
    equal: bool
    expected: str
    agreement: float | None = None
    agreement_bound: float = 1.0
    nonfinite: tuple[str, ...] = ()
    why: str = ""  # what differs between the two, where it is known (buffers in another dtype)
    unreached: str = ""  # a position-dependent feature the inputs were too short to exercise: no vouching

    @property
    def holds(self) -> bool:
        """Whether the artifact keeps what its format promises (no NaN or Inf on either side), on
        inputs long enough to exercise every position-dependent feature of the model."""
        if self.nonfinite or self.unreached:
            return False
        if self.expected == "exact":
            return self.equal
        agreed = self.agreement is None or self.agreement >= self.agreement_bound
        return agreed and self.cosine >= float(self.expected.removeprefix("cosine>="))

    def describe(self) -> str:
        """The figures in one line: what was promised and what was measured."""
        found = f"cosine {self.cosine:.6f}, max |diff| {self.max_abs:.3g}"
        if self.agreement is not None:
            found += f", integer outputs agree on {self.agreement:.2%} (at least {self.agreement_bound:.2%} promised)"
        if self.nonfinite:
            found += f", NaN or Inf from {' and '.join(self.nonfinite)}"
        notes = "".join(f"; {note}" for note in (self.unreached, self.why) if note)
        return f"expected {self.expected}: {found}{notes}"

    def as_dict(self) -> dict[str, Any]:
        found = {"max_abs": self.max_abs, "cosine": self.cosine, "equal": self.equal, "expected": self.expected}
        if self.agreement is not None:
            found |= {"agreement": self.agreement, "agreement_bound": self.agreement_bound}
        if self.nonfinite:
            found["nonfinite"] = list(self.nonfinite)
        if self.unreached:
            found["unreached"] = self.unreached
        return found | {"holds": self.holds}


class ExportParityError(SurgeryError, RuntimeError):
    """The artifact, loaded in its own runtime, does not keep what its format promises against
    the model under surgery; it was never moved into place. ``record`` (its ``parity``) has the
    figures."""

    def __init__(self, record: ExportRecord) -> None:
        self.record = record
        parity = record.parity
        if parity.unreached and replace_field(parity, unreached="").holds:  # it matched, on inputs too short
            figures = replace_field(parity, unreached="").describe()
            super().__init__(
                f"export.inputs: the {record.format} artifact matched the model under surgery on them ({figures}), "
                f"but the check {parity.unreached}; {record.path.name} was not written"
            )
            return
        super().__init__(
            f"export.format={record.format!r}: the loaded artifact computes something else than the model under "
            f"surgery ({parity.describe()}); {record.path.name} was not written"
        )


def runtime_parity(chosen: ExportFormat, tmp: Path, model: nn.Module, calls: list[Call], exact: bool) -> Parity:
    """:func:`_parity` of the written copy ``tmp``; an artifact its runtime cannot load or run (or
    inputs the model cannot take) is said in one line, and nothing is moved into place."""
    try:
        deployable = chosen.load(tmp)
    except (SurgeryError, KeyboardInterrupt):
        raise
    except Exception as err:
        raise ConfigError(
            "export.format",
            chosen.name,
            f"its runtime cannot load the written {type(model).__name__} ({first_line(err)}); nothing was written",
        ) from err
    try:
        found = _parity(chosen, deployable, model, calls, exact)
        return found if found.holds else replace_field(found, why=_buffers_differ(model, deployable))
    except (SurgeryError, KeyboardInterrupt):
        raise
    except Exception as err:
        refuse_unrunnable_inputs(model, calls, "nothing")
        raise ConfigError(
            "export.format",
            chosen.name,
            f"the written {type(model).__name__} does not run in its runtime on export's inputs "
            f"({first_line(err)}); nothing was written",
        ) from err


def _buffers_differ(model: nn.Module, deployable: Any) -> str:
    """Why a loaded module may compute otherwise than the model: buffers of the same name in
    another dtype (a model cast with ``.to(bfloat16)`` casts its rotary ``inv_freq``, which
    ``from_pretrained(dtype=...)`` keeps in float32). Empty when none differ or it is no module."""
    if not isinstance(deployable, nn.Module):
        return ""
    theirs = dict(deployable.named_buffers())
    differ = [
        (name, mine.dtype, theirs[name].dtype)
        for name, mine in model.named_buffers()
        if name in theirs and mine.is_floating_point() and mine.dtype != theirs[name].dtype
    ]
    if not differ:
        return ""
    name, mine, loaded = differ[0]
    return (
        f"the model's buffer {name} is {str(mine).removeprefix('torch.')}, the loaded one's "
        f"{str(loaded).removeprefix('torch.')} (a model cast with .to() casts buffers that from_pretrained(dtype=...) "
        "keeps): load the model with from_pretrained(dtype=...), or cast those buffers back"
    )


def parity(record: ExportRecord, model: nn.Module, calls: list[Call]) -> Parity:
    """Load ``record`` in its runtime and compare its outputs with ``model``'s on ``calls``."""
    chosen = EXPORT_FORMATS.get(record.format)
    return _parity(chosen, record.load(), model, calls, record.exact)


def _parity(chosen: ExportFormat, deployable: Any, model: nn.Module, calls: list[Call], exact: bool) -> Parity:
    """Every output tensor of ``deployable`` against ``model``'s (as it runs, all its surgery
    attached) on ``calls``, measured against what ``chosen`` promises."""
    figures = _ParityFigures()
    for call in calls:
        # routed as the model routes (inside every_expert_calibrated() too): the artifact routes so,
        # and every-expert forwards differ from it in the last bit on some CPUs
        with torch.no_grad(), routed_as("routed"):
            expected = flatten_tensors(call(model), floating_only=False)
        found = chosen.run(deployable, moved(call, device_of(deployable)))  # where the artifact runs
        if len(found) != len(expected):
            raise ConfigError("export.parity", chosen.name, f"gave {len(found)} outputs, the model {len(expected)}")
        for want, got in zip(expected, found):
            figures.add(want.detach().cpu(), got.detach().cpu(), chosen.name)
    expected_kind = "exact" if exact else f"cosine>={chosen.bound}"
    return replace_field(
        figures.result(expected_kind, 1.0 if exact else chosen.agreement), unreached=unreached(model, calls)
    )


class _ParityFigures:
    """Running parity figures: floating outputs by difference and cosine, integer and boolean
    ones by the share of equal entries, NaN or Inf on either side by who gave it."""

    def __init__(self) -> None:
        self.max_abs, self.cosine, self.equal = 0.0, 1.0, True
        self.agreement: float | None = None
        self.nonfinite: dict[str, None] = {}

    def add(self, want: Tensor, got: Tensor, name: str) -> None:
        if got.numel() != want.numel():
            raise ConfigError(
                "export.parity", name, f"gave an output of shape {tuple(got.shape)}, the model {tuple(want.shape)}"
            )
        got = got.reshape(want.shape)
        if want.is_complex():
            want, got = torch.view_as_real(want), torch.view_as_real(got.to(want.dtype))
        if want.is_floating_point():
            self._floating(want.double(), got.double())
            return
        same = want.long() == got.long() if not got.is_floating_point() else want.double() == got.double()
        share = float(same.double().mean()) if same.numel() else 1.0
        self.agreement = share if self.agreement is None else min(self.agreement, share)
        self.equal = self.equal and bool(same.all())

    def _floating(self, want: Tensor, got: Tensor) -> None:
        for side, values in (("the model under surgery", want), ("the artifact", got)):
            if not torch.isfinite(values).all():
                self.nonfinite[side] = None
        same = torch.equal(want, got)
        self.equal = self.equal and same
        if want.numel() and not same:  # equal outputs agree whatever their cosine (two zero outputs have 0)
            self.max_abs = max(self.max_abs, float((want - got).abs().max()))
            cosine = torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0)
            self.cosine = min(self.cosine, float(cosine))

    def result(self, expected: str, agreement_bound: float) -> Parity:
        if self.nonfinite:  # max(0.0, nan) is 0.0: a NaN must not fold away
            return Parity(math.inf, math.nan, False, expected, self.agreement, agreement_bound, tuple(self.nonfinite))
        return Parity(self.max_abs, self.cosine, self.equal, expected, self.agreement, agreement_bound)


@dataclass(frozen=True)
class ExportRecord:
    """What :func:`export` wrote: where, in which format, how many bytes; ``load()`` reads it
    back in its own runtime; ``parity`` compares that with the model under surgery (when
    ``export`` was given ``inputs``)."""

    path: Path
    format: str
    bytes: int
    options: dict[str, Any] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # what the model under surgery does that the file does not
    exact: bool = True  # the loaded artifact computes bit for bit what the model under surgery computes
    parity: Parity | None = None
    int8_ops: tuple[int, int] | None = None  # (weighted ops its runtime runs in int8, weighted ops), where known

    def load(self) -> Any:
        return EXPORT_FORMATS.get(self.format).load(self.path)

    def run(self, deployable: Any, batch: Any) -> list[Tensor]:
        """The output tensors of a loaded artifact (``load()``) on one batch."""
        return EXPORT_FORMATS.get(self.format).run(deployable, as_call(batch))

    def as_dict(self) -> dict[str, Any]:
        found = {"path": self.path.name, "format": self.format, "bytes": self.bytes}
        found |= {"parity": self.parity.as_dict()} if self.parity is not None else {}
        found |= {"int8_ops": list(self.int8_ops)} if self.int8_ops is not None else {}
        return found | ({"left_out": self.left_out} if self.left_out else {})


def refuse_unrunnable_inputs(model: nn.Module, calls: list[Call], name: str) -> None:
    """Raise when the model under surgery itself fails on export's ``inputs``."""
    for index, call in enumerate(calls):
        try:
            with torch.no_grad():
                call(model)
        except Exception as err:
            raise ConfigError(
                "export.inputs",
                f"batch {index}",
                f"{type(model).__name__} fails on it ({first_line(err)}); give batches the model takes "
                f"({name} was written)",
            ) from err
