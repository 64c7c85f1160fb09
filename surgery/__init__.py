"""surgery: reversible build-time and run-time surgery on PyTorch models you do not own."""

from surgery.analysis.attribution import (
    Attribution,
    AttributionDrift,
    AttributionSpec,
    attribution,
    attribution_drift,
    register_attribution,
)
from surgery.analysis.comparison import Drift, compare
from surgery.core.activations import activation_budget
from surgery.core.capture import Capture, capture
from surgery.core.distributed import distributed_calibration
from surgery.core.errors import (
    AlreadyModifiedError,
    CheckpointError,
    ConfigError,
    OutputExistsError,
    ParameterReplacedError,
    SelectionError,
    SurgeryError,
    UndoError,
)
from surgery.core.handles import Handle, HandleGroup, attached_to, compose
from surgery.core.layer_kinds import LayerKind, register_layer_kind
from surgery.core.routing import every_expert_calibrated
from surgery.core.selection import select
from surgery.core.transforms import attach_transform
from surgery.ops.build import rules
from surgery.ops.build.intercept import (
    Event,
    InterceptError,
    InterceptLog,
    RuleNeverFiredError,
    RuleNeverFiredWarning,
    intercept,
)
from surgery.ops.equivalence.awq import AwqHandle, AwqSpec, awq
from surgery.ops.equivalence.learned_rotation import LearnSpec
from surgery.ops.equivalence.rotation import RotateHandle, RotateSpec, rotate
from surgery.ops.equivalence.smoothing import SmoothHandle, SmoothSpec, smooth
from surgery.ops.experts.expert_pruning import ExpertPruneHandle, PruneExpertsSpec, prune_experts, register_router
from surgery.ops.experts.expert_scores import ExpertStats, register_expert_criterion
from surgery.ops.experts.linearizing import LinearExpertsHandle, LinearExpertsSpec, linear_experts
from surgery.ops.experts.routing import tokens_per_expert
from surgery.ops.export import formats  # noqa: F401 - the built-in deployment formats register themselves
from surgery.ops.export.exporting import export
from surgery.ops.export.format_table import ExportFormat, register_export_format
from surgery.ops.export.parity import ExportParityError, ExportRecord
from surgery.ops.numerics.grid import GridSpec, ObservedRange, register_observer
from surgery.ops.numerics.number_formats import NumberFormat, register_number_format
from surgery.ops.numerics.observers import NonFiniteError
from surgery.ops.numerics.weight_methods import QuantizedWeight, WeightProblem, register_weight_method
from surgery.ops.offload.offloaded_compression import OffloadedCompression
from surgery.ops.offload.offloading import Offloaded, offloaded
from surgery.ops.planning.choices import Choice, register_choice
from surgery.ops.planning.gguf_mixes import gguf_mix
from surgery.ops.planning.planning import PlanSpec, plan
from surgery.ops.planning.plans import Plan
from surgery.ops.quantization.kv_cache import KvCacheSpec, kv_cache_bytes, quantize_kv_cache
from surgery.ops.quantization.low_rank_branch import LowRankBranchHandle, LowRankSpec, low_rank_branch
from surgery.ops.quantization.methods.autoround import AutoRoundSettings
from surgery.ops.quantization.methods.gptq import GptaqSettings, GptqSettings
from surgery.ops.quantization.quantization import QuantizeHandle, QuantizeSpec, quantize
from surgery.ops.rewrite.rewriting import RewriteSpec, register_rewrite, rewrite_inputs
from surgery.ops.sensitivity.sensitivity import Sensitivity, SensitivitySpec, sensitivity
from surgery.ops.shrink.heads import HeadLayout, register_heads
from surgery.ops.shrink.rebuilding import rebuild
from surgery.ops.shrink.shrinking import ShrinkError, ShrinkHandle, ShrinkSpec, register_importance, shrink
from surgery.ops.sparsity.criteria import LayerStats, register_criterion
from surgery.ops.sparsity.masks import PruneHandle
from surgery.ops.sparsity.owl import OwlAllocation, owl_amounts
from surgery.ops.sparsity.pruning import prune
from surgery.ops.sparsity.spec import PruneSpec
from surgery.ops.training.distillation import DistillSpec
from surgery.ops.training.finetuning import FinetuneHandle, FinetuneSpec, finetune


def __getattr__(name: str) -> object:
    """``surgery.QuantSpec`` and ``surgery.OwlPlan``: the names :class:`GridSpec` and
    :class:`OwlAllocation` had before 0.3 (warn)."""
    if name in ("QuantSpec", "OwlPlan"):
        import warnings

        from surgery.ops.numerics.grid import DEPRECATED_QUANTSPEC
        from surgery.ops.sparsity.owl import DEPRECATED_OWLPLAN

        renamed = {"QuantSpec": (GridSpec, DEPRECATED_QUANTSPEC), "OwlPlan": (OwlAllocation, DEPRECATED_OWLPLAN)}
        new, message = renamed[name]
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return new
    raise AttributeError(f"module 'surgery' has no attribute {name!r}")


__all__ = [  # the public names by family, in the order of docs/design.md's map
    # handles, selection and capture (core)
    "Handle",
    "HandleGroup",
    "compose",
    "attached_to",
    "select",
    "capture",
    "Capture",
    "attach_transform",
    "register_heads",
    "HeadLayout",
    "LayerKind",
    "register_layer_kind",
    "distributed_calibration",
    "activation_budget",
    # errors
    "SurgeryError",
    "ConfigError",
    "SelectionError",
    "AlreadyModifiedError",
    "CheckpointError",
    "NonFiniteError",
    "OutputExistsError",
    "ParameterReplacedError",
    "UndoError",
    "ShrinkError",
    "InterceptError",
    "RuleNeverFiredError",
    "RuleNeverFiredWarning",
    "ExportParityError",
    # numerics: grids, observers, number formats, the weight-method contract
    "GridSpec",
    "ObservedRange",
    "register_observer",
    "NumberFormat",
    "register_number_format",
    "WeightProblem",
    "QuantizedWeight",
    "register_weight_method",
    "GptqSettings",
    "GptaqSettings",
    "AutoRoundSettings",
    # build: intercept and its rules
    "intercept",
    "rules",
    "Event",
    "InterceptLog",
    # experts: a mixture-of-experts layer's experts as layers of their own
    "linear_experts",
    "LinearExpertsSpec",
    "LinearExpertsHandle",
    "every_expert_calibrated",
    "tokens_per_expert",
    "prune_experts",
    "PruneExpertsSpec",
    "ExpertPruneHandle",
    "register_expert_criterion",
    "ExpertStats",
    "register_router",
    # shrink
    "shrink",
    "ShrinkSpec",
    "ShrinkHandle",
    "rebuild",
    "register_importance",
    # offload
    "offloaded",
    "Offloaded",
    "OffloadedCompression",
    # sparsity
    "prune",
    "PruneSpec",
    "PruneHandle",
    "register_criterion",
    "LayerStats",
    "owl_amounts",
    "OwlAllocation",
    # equivalence
    "smooth",
    "SmoothSpec",
    "SmoothHandle",
    "awq",
    "AwqSpec",
    "AwqHandle",
    "rotate",
    "RotateHandle",
    "RotateSpec",
    "LearnSpec",
    # quantization
    "quantize",
    "QuantizeSpec",
    "QuantizeHandle",
    "quantize_kv_cache",
    "KvCacheSpec",
    "low_rank_branch",
    "LowRankSpec",
    "LowRankBranchHandle",
    "kv_cache_bytes",
    # training
    "finetune",
    "FinetuneSpec",
    "FinetuneHandle",
    "DistillSpec",
    # export
    "export",
    "ExportRecord",
    "register_export_format",
    "ExportFormat",
    # sensitivity
    "sensitivity",
    "SensitivitySpec",
    "Sensitivity",
    # planning: one budget across every knob
    "plan",
    "PlanSpec",
    "gguf_mix",
    "Plan",
    "Choice",
    "register_choice",
    # rewrite
    "rewrite_inputs",
    "RewriteSpec",
    "register_rewrite",
    # analysis
    "compare",
    "Drift",
    "attribution",
    "Attribution",
    "AttributionSpec",
    "register_attribution",
    "attribution_drift",
    "AttributionDrift",
]
