"""surgery: reversible build-time and run-time surgery on PyTorch models you do not own."""

from surgery import rules
from surgery.comparison import Drift, compare
from surgery.errors import (
    AlreadyModifiedError,
    CheckpointError,
    ConfigError,
    OutputExistsError,
    SelectionError,
    SurgeryError,
    UndoError,
)
from surgery.handles import Handle, HandleGroup, compose
from surgery.intercept import (
    Event,
    InterceptError,
    InterceptLog,
    RuleNeverFiredError,
    RuleNeverFiredWarning,
    intercept,
)
from surgery.observers import NonFiniteError, QuantSpec
from surgery.pruning import PruneHandle, prune
from surgery.quantization import QuantizeHandle, quantize
from surgery.rewriting import rewrite_inputs
from surgery.selection import select

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
