"""surgery: reversible build-time and run-time surgery on PyTorch models you do not own."""

from surgery.ops import rules
from surgery.analysis.comparison import Drift, compare
from surgery.core.errors import (
    AlreadyModifiedError,
    CheckpointError,
    ConfigError,
    OutputExistsError,
    SelectionError,
    SurgeryError,
    UndoError,
)
from surgery.core.handles import Handle, HandleGroup, compose
from surgery.ops.intercept import (
    Event,
    InterceptError,
    InterceptLog,
    RuleNeverFiredError,
    RuleNeverFiredWarning,
    intercept,
)
from surgery.ops.observers import NonFiniteError, QuantSpec
from surgery.ops.pruning import PruneHandle, prune
from surgery.ops.quantization import QuantizeHandle, quantize
from surgery.ops.rewriting import rewrite_inputs
from surgery.core.selection import select

__all__ = [
    "AlreadyModifiedError",
    "CheckpointError",
    "ConfigError",
    "Drift",
    "Event",
    "Handle",
    "HandleGroup",
    "InterceptError",
    "InterceptLog",
    "NonFiniteError",
    "OutputExistsError",
    "PruneHandle",
    "QuantSpec",
    "QuantizeHandle",
    "RuleNeverFiredError",
    "RuleNeverFiredWarning",
    "SelectionError",
    "SurgeryError",
    "UndoError",
    "compare",
    "compose",
    "intercept",
    "prune",
    "quantize",
    "rewrite_inputs",
    "rules",
    "select",
]
