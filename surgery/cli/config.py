"""Typed run configuration: dataclasses that validate themselves, and their YAML loader."""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgery.analysis.attribution import AttributionSpec
from surgery.cli.fields import one_of, positive_int
from surgery.cli.steps import STEPS, step_named
from surgery.core.errors import NO_VALUE, ConfigError, ConfigTypeError
from surgery.core.hf_loading import check_tokenizer_folder
from surgery.core.inputs import present_device
from surgery.ops.export.format_table import EXPORT_FORMATS
from surgery.ops.planning.budget import ALLOWED as BUDGET_ALLOWED
from surgery.tasks import task_named
from surgery.tasks.tinyllama import FOLDER as TINYLLAMA_FOLDER
from surgery.tasks.tinymoe import FOLDER as TINYMOE_FOLDER
from surgery.tasks.tinyqwen3 import FOLDER as TINYQWEN3_FOLDER

log = logging.getLogger("surgery")

MODEL_SOURCES = ("torchvision", "digits_cnn", "mnist1d_cnn", "tinylm", "timm", "hf", "factory")
HF_TASKS = ("causal_lm", "sequence_classification", "image_classification")
CHECKPOINT_FORMATS = ("safetensors", "pt")

SHIPPED_FOLDER = "shipped"  # model.path (model=hf): surgery's trained tiny Llama (surgery.tasks.tinyllama)
SHIPPED_FOLDERS = {"tinymoe": TINYMOE_FOLDER, "tinyqwen3": TINYQWEN3_FOLDER}  # model.name with model.path=shipped


MODEL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Which model to build: ``source`` + ``name``, optionally loading a checkpoint.

    ``source: digits_cnn`` is surgery's small CNN for the digits data, ``mnist1d_cnn`` its 1-d
    CNN for MNIST-1D, ``tinylm`` its byte-level transformer language model; ``weights:
    shipped`` loads their trained checkpoints (reproduced by the scripts in ``scripts/``).
    """

    source: str = "torchvision"
    name: str | None = "resnet50"
    weights: str | None = None
    num_classes: int = 1000
    task: str = "causal_lm"  # hf: which head (HF_TASKS)
    config: dict[str, Any] | None = None  # hf: AutoConfig.for_model(name, **config)
    path: str | None = None  # hf: a local pretrained folder (local_files_only, safetensors); shipped: the tiny Llama
    kwargs: dict[str, Any] | None = None  # timm.create_model / the factory's arguments
    _target_: str | None = None  # factory: the dotted path of a callable returning the model
    offload: bool = False  # hf with path: weights stay in the folder's files, read block by block
    offload_folder: str | None = None  # offload: where finished blocks go (a run restarts from it); None: temporary
    device: str = "cpu"  # where the model and every batch go: cpu, cuda, cuda:N, mps
    dtype: str = "float32"  # the model's floating dtype (and its floating inputs'): float32, bfloat16, float16

    def __post_init__(self) -> None:
        one_of("model.source", self.source, MODEL_SOURCES)
        shipped = self.source == "hf" and self.path == SHIPPED_FOLDER
        shipped_name = (self.name if self.name in SHIPPED_FOLDERS else "tinyllama") if shipped else None
        if shipped:  # the trained tiny Llama (surgery/assets/tinyllama), or model.name=tinymoe / tinyqwen3
            self.path = str(SHIPPED_FOLDERS.get(self.name, TINYLLAMA_FOLDER))
        if not isinstance(self.offload, bool):
            raise ConfigError("model.offload", self.offload, "must be true or false")
        if self.offload and (self.source != "hf" or self.path is None):
            raise ConfigError(
                "model.offload", True, "needs model=hf with model.path=FOLDER (a Hugging Face folder of safetensors)"
            )
        if self.offload_folder is not None and not self.offload:
            raise ConfigError("model.offload_folder", self.offload_folder, "applies with model.offload=true only")
        positive_int("model.num_classes", self.num_classes)
        present_device(self.device, "model.device")
        one_of("model.dtype", self.dtype, MODEL_DTYPES)
        if self.offload and self.dtype != "float32":
            raise ConfigError("model.dtype", self.dtype, "with model.offload=true the folder's own dtypes are read")
        self.config, self.kwargs = dict(self.config or {}), dict(self.kwargs or {})
        if self.source == "hf":
            one_of("model.task", self.task, HF_TASKS)
        if self.source == "factory":
            if not self._target_:
                raise ConfigError(
                    "model._target_",
                    self._target_,
                    "model=factory needs the dotted path of a "
                    "callable returning the model, e.g. model._target_=torchvision.models.resnet18",
                )
            self.name = self._target_  # what the report calls the model
        elif (self.source != "hf" or self.path is None) and not self.name:
            raise ConfigError("model.name", self.name, f"model={self.source} needs a model name")
        if self.path is not None and self.source != "hf":
            raise ConfigError("model.path", self.path, "applies to model=hf only (a local pretrained folder)")
        if self.path is not None:  # what the report calls the model (not a recipe's default name)
            self.name = shipped_name or self.path


@dataclass
class DataConfig:
    """The inputs used by the checks: ``synthetic`` is seeded Gaussian noise images; ``digits``
    is the test split of scikit-learn's 8x8 digits, ``mnist1d`` the test split of MNIST-1D and
    ``tinylm`` the held-out bytes of the language model's corpus (labels give accuracy; for
    ``tinylm`` also perplexity), ``batches`` of ``batch_size`` (channels and image_size do not apply
    to them, and their splits are always the ones the shipped checkpoints were trained
    against, so ``seed`` does not apply either)."""

    kind: str = "synthetic"
    batch_size: int = 4
    batches: int = 2
    channels: int = 3
    image_size: int = 224
    seed: int = 0
    root: str | None = None  # imagefolder: a folder of class sub-folders of images
    resize: int | None = None  # imagefolder: shorter side before the centre crop (default image_size * 8/7)
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])  # imagefolder: normalisation
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    seq_len: int = 32  # tokens: tokens per sequence
    vocab_size: int | None = None  # tokens: random ids below it (default: the model's config.vocab_size)
    text: str | None = None  # tokens: a local text file, tokenised by `tokenizer`
    tokenizer: str | None = None  # tokens: a local tokenizer folder (AutoTokenizer, local_files_only)
    activation_budget: int | None = None  # bytes of calibration activations held in memory (null: 1/4 of free)
    activation_folder: str | None = None  # where activations beyond the budget are spilled (null: the temp folder)
    device: str = "cpu"  # where batches go: model.device's (a run sets it; not set apart)
    dtype: str = "float32"  # floating batches' dtype: model.dtype's (a run sets it)

    def __post_init__(self) -> None:
        task_named(self.kind)
        for name in ("batch_size", "batches", "channels", "image_size", "seq_len"):
            positive_int(f"data.{name}", getattr(self, name))
        if self.kind == "imagefolder" and not self.root:
            raise ConfigError(
                "data.root",
                self.root,
                "data=imagefolder needs data.root=PATH (a folder of class sub-folders of images)",
            )
        if self.vocab_size is not None:
            positive_int("data.vocab_size", self.vocab_size)
        if self.activation_budget is not None and (
            isinstance(self.activation_budget, bool)
            or not isinstance(self.activation_budget, int)
            or self.activation_budget < 0
        ):
            raise ConfigError(
                "data.activation_budget", self.activation_budget, "must be null or a number of bytes >= 0"
            )
        if self.activation_folder is not None and not Path(self.activation_folder).is_dir():
            raise ConfigError("data.activation_folder", self.activation_folder, "must be an existing folder")
        if self.resize is not None:
            positive_int("data.resize", self.resize)
            if self.resize < self.image_size:
                raise ConfigError(
                    "data.resize",
                    self.resize,
                    f"must be null or an integer >= data.image_size "
                    f"({self.image_size}): the image is resized, then centre-cropped to image_size",
                )
        for name, lowest in (("mean", None), ("std", 0.0)):
            values = getattr(self, name)
            if (
                not isinstance(values, (list, tuple))
                or not values
                or not all(
                    isinstance(v, (int, float))
                    and not isinstance(v, bool)
                    and math.isfinite(v)
                    and (lowest is None or v > lowest)
                    for v in values
                )
            ):
                raise ConfigError(
                    f"data.{name}",
                    list(values) if isinstance(values, (list, tuple)) else values,
                    "must be a list of finite numbers" + (", every std positive" if lowest == 0.0 else ""),
                )
        if self.kind == "imagefolder" and self.channels not in (1, 3):
            raise ConfigError("data.channels", self.channels, "must be 3 (RGB) or 1 (grayscale) for data=imagefolder")
        for name in ("mean", "std") if self.kind == "imagefolder" else ():
            if len(getattr(self, name)) not in (1, self.channels):
                raise ConfigError(
                    f"data.{name}",
                    list(getattr(self, name)),
                    f"needs one value per channel ({self.channels}, data.channels) or one for all",
                )
        if (self.text is None) != (self.tokenizer is None):
            raise ConfigError(
                "data.text" if self.text is None else "data.tokenizer",
                None,
                "data.text and data.tokenizer go together (a text file and a local tokenizer folder)",
            )


DRIFT_RANGES = {
    "min_cosine": (-1.0, 1.0),
    "min_sqnr_db": (-math.inf, math.inf),
    "min_top1_agreement": (0.0, 1.0),
    "max_abs": (0.0, math.inf),
    "max_accuracy_drop": (0.0, 100.0),
    "min_attribution_cosine": (-1.0, 1.0),
}


@dataclass(frozen=True)
class AttributionConfig(AttributionSpec):
    """``attribution:``: the fields of :class:`~surgery.AttributionSpec` (``method``, ``select``,
    ``target``, ``top_k``) and how many evaluation ``batches`` are explained."""

    batches: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        positive_int("attribution.batches", self.batches)


@dataclass
class DriftThresholds:
    """Bounds the drift check enforces between the original and the modified model."""

    min_cosine: float | None = None
    min_sqnr_db: float | None = None
    min_top1_agreement: float | None = None
    max_abs: float | None = None
    max_accuracy_drop: float | None = None  # in points (percent), with labelled data
    min_attribution_cosine: float | None = None  # mean cosine of the attribution maps (needs attribution:)

    def __post_init__(self) -> None:
        for name, (low, high) in DRIFT_RANGES.items():
            value = getattr(self, name)
            if value is not None and not (low <= value <= high and math.isfinite(float(value))):
                raise ConfigError(f"checks.drift.{name}", value, f"must be null or {_describe_range(low, high)}")


def _describe_range(low: float, high: float) -> str:
    if math.isfinite(low) and math.isfinite(high):
        return f"a number in [{low:g}, {high:g}]"
    return f"a finite number >= {low:g}" if math.isfinite(low) else "a finite number"


@dataclass
class ChecksConfig:
    """Round-trip checks: which run (all five by default), the drift bounds, and how much of the
    weights a step may leave unchanged without being told to (``max_untouched``: a ``coverage`` row
    fails above it)."""

    enabled: list[str] = field(default_factory=lambda: list(CHECK_NAMES))
    drift: DriftThresholds = field(default_factory=DriftThresholds)
    per_layer: bool = True
    max_untouched: float = 0.5  # the share of the weight bytes a step may leave unchanged unless excluded

    def __post_init__(self) -> None:
        for name in self.enabled:
            one_of("checks.enabled", name, CHECK_NAMES)
        if isinstance(self.max_untouched, bool) or not isinstance(self.max_untouched, (int, float)):
            raise ConfigTypeError("checks.max_untouched", self.max_untouched, "must be a number from 0 to 1")
        if not 0.0 <= self.max_untouched <= 1.0:
            raise ConfigError("checks.max_untouched", self.max_untouched, "must be from 0 to 1 (1: allow any share)")


@dataclass
class OutputConfig:
    """What the run writes into its output folder."""

    checkpoint: str = "safetensors"
    plots: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        one_of("output.checkpoint", self.checkpoint, CHECKPOINT_FORMATS)


@dataclass
class ExportConfig:
    """``export:``: write the model under surgery in a registered format (``null``: none) as
    ``export.<suffix>`` beside the report, with the format's ``options`` (``type``: the
    shorthand for ``options.type``, e.g. a GGUF type)."""

    format: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    type: str | None = None

    def __post_init__(self) -> None:
        if self.type is not None:
            given = self.options.get("type", self.type)
            if given != self.type:
                raise ConfigError("export.type", self.type, f"and export.options.type={given!r} disagree; set one")
            self.options = {**self.options, "type": self.type}
        if self.format is not None:
            EXPORT_FORMATS.get(self.format)
        elif self.options:
            raise ConfigError("export.options", dict(self.options), "apply to an export; set export.format too")
        if isinstance(self.options.get("tokenizer"), str):  # refused before the run, not at its end
            check_tokenizer_folder(self.options["tokenizer"], "export.options.tokenizer")

    @property
    def file_name(self) -> str | None:
        if self.format is None:
            return None
        suffix = EXPORT_FORMATS.get(self.format).suffix
        return f"export.{suffix}" if suffix else "export"


CHECK_NAMES = ("identity", "restore", "bake", "save_load", "drift", "deploy")  # deploy: when exporting
BUILD_KINDS = ("swap", "wrap", "parameter", "buffer")


@dataclass
class BuildRuleConfig:
    """One build-time rule from a recipe's ``build:`` list (see :mod:`surgery.cli.build`).

    ``match`` is ``type:ClassName`` (torch.nn or a dotted path), a glob on the local attribute
    name, or a list of those. ``swap`` builds ``to(**kwargs)`` or calls ``factory(old, **kwargs)``;
    ``wrap`` calls ``wrapper(old, **kwargs)``; ``parameter``/``buffer`` rules cast to ``dtype``,
    set ``requires_grad``, or re-initialise in place with ``init`` (e.g. torch.nn.init.zeros_).
    """

    kind: str = "swap"
    match: Any = None
    to: str | None = None
    factory: str | None = None
    wrapper: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    requires_grad: bool | None = None
    init: str | None = None

    def __post_init__(self) -> None:
        one_of("build[].kind", self.kind, BUILD_KINDS)
        if self.match is None:
            raise ConfigError("build[].match", None, "is required: 'type:ReLU', a name glob, or a list of them")


OBJECTIVE_METRICS = {  # name -> (report path, bound kind in subject_to: "min" = at least, "max" = at most)
    "sparsity": ("sparsity", "min"),
    "cosine": ("drift.cosine", "min"),
    "sqnr_db": ("drift.sqnr_db", "min"),
    "top1_agreement": ("drift.top1_agreement", "min"),
    "max_abs": ("drift.max_abs", "max"),
    "accuracy": ("accuracy.candidate", "min"),
    "accuracy_drop": ("accuracy.drop_points", "max"),
    "perplexity": ("perplexity.candidate", "max"),
    "params_nonzero": ("params.nonzero", "max"),
}


@dataclass
class ObjectiveConfig:
    """What a search optimises (``hydra/sweeper=optuna``): the run returns ``maximize`` (or
    ``minimize``) of its report, penalised by ``penalty × (1 + shortfall)`` when a
    ``subject_to`` bound is missed (``cosine: 0.95`` = at least 0.95; ``max_abs``,
    ``accuracy_drop``, ``perplexity``, ``params_nonzero`` are upper bounds)."""

    maximize: str | None = None
    minimize: str | None = None
    subject_to: dict[str, float] = field(default_factory=dict)
    penalty: float = 1.0

    def __post_init__(self) -> None:
        if (self.maximize is None) == (self.minimize is None):
            raise ConfigError(
                "objective",
                {"maximize": self.maximize, "minimize": self.minimize},
                "set exactly one of objective.maximize and objective.minimize",
            )
        for key, name in (
            ("maximize", self.maximize),
            ("minimize", self.minimize),
            *((f"subject_to.{bound}", bound) for bound in self.subject_to),
        ):
            if name is not None:
                one_of(f"objective.{key}", name, tuple(OBJECTIVE_METRICS))
        if not math.isfinite(self.penalty) or self.penalty <= 0:
            raise ConfigError("objective.penalty", self.penalty, "must be a positive number")


BUILT_IN_STEPS = tuple(STEPS.names())  # registered by surgery.cli.steps, before any plugin's
StepSections = dataclasses.make_dataclass(  # a field per built-in step, its settings or None
    "StepSections",
    [(name, typing.Optional[STEPS.get(name).settings], field(default=None)) for name in BUILT_IN_STEPS],  # noqa: UP045
)


@dataclass
class RunConfig(StepSections):  # type: ignore[valid-type, misc]
    """One run of a recipe: build ``model`` (with ``build`` rules), apply ``steps`` in order,
    check, report, export. Each built-in step's settings are the field of its name (a field per
    registered built-in step, from :data:`StepSections`); a step a ``plugins`` module registers
    keeps its settings in ``step_settings``."""

    recipe: str = "custom"
    seed: int = 0
    plugins: list[str] = field(default_factory=list)  # modules imported first: they register steps, methods...
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    build: list[BuildRuleConfig] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    budget: Any = None  # a recipe's plan budget, interpolated into plan.budget (budget=4.5bpw)
    step_settings: dict[str, Any] = field(default_factory=dict)  # settings of plugin steps, by step name
    inspect: bool = False
    objective: ObjectiveConfig | None = None  # what a search (hydra/sweeper=optuna) optimises
    attribution: AttributionConfig | None = None  # what both models look at: maps, drift, attribution.png
    select_only: bool = False  # dry run: print what each step selects and skips; change and write nothing
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def __post_init__(self) -> None:
        if self.data.device not in ("cpu", self.model.device):
            raise ConfigError("data.device", self.data.device, "follows model.device; set model.device instead")
        self.data.device, self.data.dtype = self.model.device, self.model.dtype
        if not self.steps and not self.build and not self.inspect:
            raise ConfigError(
                "steps",
                self.steps,
                f"must list at least one of {', '.join(STEPS.names())} (or the recipe must have build: rules)",
            )
        for index, name in enumerate(self.steps):
            step = step_named(name)
            if name in self.steps[:index]:
                raise ConfigError(
                    "steps", self.steps, f"lists '{name}' twice; each step runs once, with its '{name}:' settings"
                )
            if self.settings(name) is None:
                raise ConfigError(name, None, f"step '{name}' is listed in steps but has no '{name}:' settings")
            if step.needs_labels and not task_named(self.data.kind).labelled:
                raise ConfigError(
                    name,
                    NO_VALUE,
                    f"needs labelled training data and data.kind is "
                    f"{self.data.kind!r}; use data=digits, mnist1d, tinylm or imagefolder",
                )
        if self.checks.drift.min_attribution_cosine is not None and self.attribution is None:
            raise ConfigError(
                "checks.drift.min_attribution_cosine",
                self.checks.drift.min_attribution_cosine,
                "bounds the attribution maps' cosine; set attribution: {method, select} (or recipe=explain)",
            )
        if self.sensitivity is not None and "sensitivity" not in self.steps:
            raise ConfigError("sensitivity", NO_VALUE, "has settings but is not in steps; add it: steps=[sensitivity]")
        if "plan" in self.steps and self.plan is not None and self.plan.budget is None:
            raise ConfigError("plan.budget", None, f"is required: {BUDGET_ALLOWED} (or a top-level budget=4.5bpw)")
        if self.budget is not None and "plan" not in self.steps:
            raise ConfigError(
                "budget", self.budget, "is the plan step's budget; add it: steps=[plan] (recipe=plan_llama)"
            )
        if self.objective is not None:
            self._check_objective()
        self._target_export()

    def _target_export(self) -> None:
        """``export.format=F`` on a recipe that quantizes without a ``quantize.target``: the
        simulation takes F's deployment rules, so the accuracy reported is the export's."""
        if self.export.format is None or self.quantize is None or "quantize" not in self.steps:
            return
        if self.quantize.target is not None or EXPORT_FORMATS.get(self.export.format).target is None:
            return
        if self.quantize.train:
            return  # deployment rules apply to post-training quantization
        log.info("quantize.target=%s, from export.format", self.export.format)
        self.quantize = dataclasses.replace(self.quantize, target=self.export.format)

    def settings(self, step: str) -> Any:
        """The settings of ``step``: its field for a built-in step, else from ``step_settings``."""
        if step in BUILT_IN_STEPS:
            return getattr(self, step)
        return self.step_settings.get(step)

    def _check_objective(self) -> None:
        needs = {
            name: OBJECTIVE_METRICS[name][0].split(".")[0]
            for name in [self.objective.maximize, self.objective.minimize, *self.objective.subject_to]
            if name
        }
        for name, part in needs.items():
            if (
                part == "accuracy"
                and not task_named(self.data.kind).labelled
                or (part == "perplexity" and getattr(task_named(self.data.kind).metric, "name", None) != "perplexity")
            ):
                raise ConfigError(
                    "objective",
                    name,
                    f"needs {'labelled' if part == 'accuracy' else 'tinylm'} data and data.kind is {self.data.kind!r}",
                )
