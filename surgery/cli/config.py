"""Typed run configuration: dataclasses that validate themselves, and their YAML loader."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from surgery.core.errors import NO_VALUE, ConfigError
from surgery.ops.criteria import as_criterion
from surgery.ops.observers import QuantSpec
from surgery.ops.pruning import check_pattern, validate_arguments
from surgery.ops.weight_methods import weight_method

STEPS = ("prune", "quantize", "rewrite", "finetune", "shrink")
MODEL_SOURCES = ("torchvision", "digits_cnn", "mnist1d_cnn", "tinylm", "timm", "hf", "factory")
HF_TASKS = ("causal_lm", "sequence_classification", "image_classification")
DATA_KINDS = ("synthetic", "digits", "mnist1d", "tinylm", "imagefolder", "tokens")
LABELLED_KINDS = ("digits", "mnist1d", "tinylm", "imagefolder")  # real data with labels: accuracy, fine-tuning
CHECKPOINT_FORMATS = ("safetensors", "pt")


def _positive_int(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(name, value, "must be an integer >= 1")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"must be one of {', '.join(allowed)}")


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
    path: str | None = None  # hf: a local pretrained folder (local_files_only, safetensors)
    kwargs: dict[str, Any] | None = None  # timm.create_model / the factory's arguments
    _target_: str | None = None  # factory: the dotted path of a callable returning the model

    def __post_init__(self) -> None:
        _one_of("model.source", self.source, MODEL_SOURCES)
        _positive_int("model.num_classes", self.num_classes)
        self.config, self.kwargs = dict(self.config or {}), dict(self.kwargs or {})
        if self.source == "hf":
            _one_of("model.task", self.task, HF_TASKS)
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
        if self.path is not None:
            self.name = self.path  # what the report calls the model (not a recipe's default name)


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

    def __post_init__(self) -> None:
        _one_of("data.kind", self.kind, DATA_KINDS)
        for name in ("batch_size", "batches", "channels", "image_size", "seq_len"):
            _positive_int(f"data.{name}", getattr(self, name))
        if self.kind == "imagefolder" and not self.root:
            raise ConfigError(
                "data.root",
                self.root,
                "data=imagefolder needs data.root=PATH (a folder of class sub-folders of images)",
            )
        if self.vocab_size is not None:
            _positive_int("data.vocab_size", self.vocab_size)
        if self.resize is not None:
            _positive_int("data.resize", self.resize)
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


class _PlainYaml(yaml.SafeLoader):
    """Safe YAML without anchors and aliases: a plan is a flat mapping, and nested aliases
    (a "billion laughs" file of 1 kB) would expand for minutes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent) or getattr(self.peek_event(), "anchor", None):
            raise yaml.composer.ComposerError(
                None, None, "anchors and aliases are not allowed in a plan", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


PLAN_BYTES = 10 * 2**20


def read_plan_yaml(path: str, field: str) -> Any:
    """A plan file (``{layer: amount}``) read as plain YAML: at most 10 MiB, no tags beyond
    the safe ones, no aliases."""
    try:
        if os.path.getsize(path) > PLAN_BYTES:
            raise ConfigError(
                field, path, f"is larger than {PLAN_BYTES // 2**20} MiB; a plan lists one amount per layer"
            )
        with open(path, encoding="utf-8") as handle:
            return yaml.load(handle, Loader=_PlainYaml)  # noqa: S506 - a SafeLoader subclass
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(field, path, f"cannot be read as a plan YAML file ({type(err).__name__})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            field, path, f"is not a plain YAML plan{where} ({' '.join(str(problem).split())[:120]})"
        ) from None


@dataclass
class PruneConfig:
    """Arguments of :func:`surgery.prune` (see its docstring)."""

    amount: float = 0.5
    method: str = "l1_unstructured"
    scope: str = "layer"
    select: Any = None
    exclude: Any = None
    n: Any = 2.0
    dim: int = 0
    seed: int = 0
    pattern: str | None = None  # "N:M" semi-structured sparsity, e.g. "2:4" (with amount 0.5)
    calibration_batches: int = 8  # batches of the data's calibration split, for calibrated methods
    blocks: Any = None  # sparsegpt: blocks calibrated in sequence (null: found automatically; false: layer by layer)
    amounts: Any = None  # {layer: amount} overriding amount, or the path of a plan.yaml from recipe=sensitivity

    def __post_init__(self) -> None:
        validate_arguments(self.amount, self.method, self.scope, self.n, self.seed)
        if self.pattern is not None:
            check_pattern(self.pattern, float(self.amount), as_criterion(self.method))
        _positive_int("prune.calibration_batches", self.calibration_batches)
        self.layer_amounts()  # a missing or malformed plan file is refused before any work

    def layer_amounts(self) -> dict[str, float] | None:
        """``amounts`` as a dict: given inline, or read from a plan YAML file."""
        if self.amounts is None or isinstance(self.amounts, dict):
            return self.amounts
        if not isinstance(self.amounts, str):
            raise ConfigError("prune.amounts", self.amounts, "must be {layer: amount} or the path of a plan.yaml")
        loaded = read_plan_yaml(self.amounts, "prune.amounts")
        if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
            raise ConfigError("prune.amounts", self.amounts, "must hold a mapping {layer: amount}")
        return loaded

    @property
    def calibrated(self) -> bool:
        """Whether the method needs calibration batches (wanda, sparsegpt, taylor)."""
        return as_criterion(self.method).needs_calibration

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`surgery.prune` (without calibration)."""
        blocks = {} if self.blocks is None else {"blocks": self.blocks}
        return {
            "method": self.method,
            "scope": self.scope,
            "select": self.select,
            "exclude": self.exclude or None,
            "n": self.n,
            "dim": self.dim,
            "seed": self.seed,
            "pattern": self.pattern,
            "amounts": self.layer_amounts(),
        } | blocks


@dataclass
class ShrinkConfig:
    """Arguments of :func:`surgery.shrink`: coupled channels removed for real, traced on one
    batch of the data's calibration split; ``latency_batches`` are the batch sizes timed dense
    against shrunk (one thread)."""

    amount: float = 0.5
    select: Any = None
    exclude: Any = None
    scope: str = "layer"
    round_to: int = 1
    latency_batches: list[int] = field(default_factory=lambda: [1, 8])

    def __post_init__(self) -> None:
        if isinstance(self.amount, bool) or not isinstance(self.amount, (int, float)) or not 0 <= self.amount <= 1:
            raise ConfigError("shrink.amount", self.amount, "must be a number in [0, 1]")
        _one_of("shrink.scope", self.scope, ("layer", "global"))
        _positive_int("shrink.round_to", self.round_to)
        for size in self.latency_batches:
            _positive_int("shrink.latency_batches", size)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`surgery.shrink` (without the amount and example inputs)."""
        return {"select": self.select, "exclude": self.exclude or None, "scope": self.scope, "round_to": self.round_to}


@dataclass
class SensitivityConfig:
    """Arguments of :func:`surgery.sensitivity`: each selected layer pruned alone at each of
    ``amounts`` and measured (accuracy with labelled data, perplexity for ``data=tinylm``, else
    output drift); with ``target_sparsity``, a per-layer plan written to ``plan.yaml``."""

    amounts: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 0.9])
    method: str = "l1_unstructured"
    select: Any = None
    exclude: Any = None
    target_sparsity: float | None = None
    calibration_batches: int = 8  # for calibrated methods (wanda, sparsegpt, gptq)
    bits: list[int] | None = None  # quantize each layer's weight alone at these widths instead of pruning
    weights: QuantSettings | None = None  # with bits: the other weight settings (default int per channel)

    def __post_init__(self) -> None:
        validate_arguments(0.5, self.method, "layer", 2.0, 0)
        _positive_int("sensitivity.calibration_batches", self.calibration_batches)
        if self.bits is not None and self.target_sparsity is not None:
            raise ConfigError(
                "sensitivity.target_sparsity",
                self.target_sparsity,
                "plans pruning amounts, and "
                "sensitivity.bits measures quantization; pass sensitivity.target_sparsity=null with it",
            )
        if self.bits is not None:
            for width in self.bits:
                if not 2 <= width <= 8:
                    raise ConfigError("sensitivity.bits", width, "each bit width must be an integer in [2, 8]")
        self.weight_spec()
        for amount in self.amounts:
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 < amount <= 1.0:
                raise ConfigError("sensitivity.amounts", amount, "each amount must be a number in (0, 1]")
        target = self.target_sparsity
        if target is not None and not 0.0 <= target <= max(self.amounts, default=0.0):
            raise ConfigError(
                "sensitivity.target_sparsity",
                target,
                f"must be null or a number in [0, {max(self.amounts, default=0.0):g}] (the largest amount tried)",
            )

    def weight_spec(self) -> QuantSpec | None:
        return _spec(self.weights, "sensitivity.weights")


@dataclass
class QuantSettings:
    """The YAML schema of ``quantize.weights`` / ``quantize.activations``: the fields of
    :class:`~surgery.ops.observers.QuantSpec` (which is frozen, so OmegaConf cannot merge into it)."""

    bits: int = 8
    symmetric: bool = False
    per_channel: bool = False
    observer: str = "minmax"
    percentile: float = 99.99
    averaging: float = 0.01
    method: str = "rtn"  # weights: rtn (round to nearest) or gptq (calibrated)
    group_size: int | None = None  # weights: one scale per this many consecutive inputs of each output


def _spec(settings: QuantSettings | QuantSpec | None, field_name: str) -> QuantSpec | None:
    if settings is None or isinstance(settings, QuantSpec):
        return settings
    return QuantSpec.build(dict(vars(settings)), field_name)


@dataclass
class QuantizeConfig:
    """Arguments of :func:`surgery.quantize`; ``null`` weights or activations turn that part off.

    Activations are calibrated on ``calibration_batches`` batches of the data's calibration
    split (training images for ``digits``, differently seeded noise for ``synthetic``).
    """

    weights: QuantSettings | None = field(
        default_factory=lambda: QuantSettings(bits=8, symmetric=True, per_channel=True)
    )
    activations: QuantSettings | None = None
    select: Any = None
    exclude: Any = None
    where: str = "output"
    calibration_batches: int = 4
    train: bool = False  # quantization-aware training: float shadows, fake-quantized in the forward
    freeze_observers_after: int | None = None  # with train: optimizer steps before activation ranges freeze

    def __post_init__(self) -> None:
        if self.weights is None and self.activations is None:
            raise ConfigError("quantize", None, "set quantize.weights, quantize.activations or both")
        self.weight_spec(), self.activation_spec()  # validated now: errors name quantize.weights.<key>
        _one_of("quantize.where", self.where, ("output", "input"))
        _positive_int("quantize.calibration_batches", self.calibration_batches)

    def weight_spec(self) -> QuantSpec | None:
        return _spec(self.weights, "quantize.weights")

    def activation_spec(self) -> QuantSpec | None:
        return _spec(self.activations, "quantize.activations")

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration batches (activations, or GPTQ weights)."""
        weights = self.weight_spec()
        return self.activations is not None or (weights is not None and weight_method(weights.method).needs_calibration)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`surgery.quantize` (without calibration)."""
        return {
            "weights": self.weight_spec(),
            "activations": self.activation_spec(),
            "select": self.select,
            "exclude": self.exclude or None,
            "where": self.where,
            "train": self.train,
            "freeze_observers_after": self.freeze_observers_after,
        }


@dataclass
class FinetuneConfig:
    """Arguments of :func:`surgery.finetune`: training on the data's training split (labelled
    data only: ``data=digits``) with every earlier step attached, in ``batch_size`` batches."""

    epochs: int = 3
    lr: float = 1e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    batch_size: int = 32
    eval_every: int | None = None  # steps between accuracy points of the curve (default: each epoch)

    def __post_init__(self) -> None:
        from surgery.ops.finetuning import OPTIMIZERS

        if self.epochs < 0:
            raise ConfigError("finetune.epochs", self.epochs, "must be an integer >= 0")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"finetune.{name}", value, "must be a finite number >= 0")
        _one_of("finetune.optimizer", self.optimizer, tuple(OPTIMIZERS.names()))
        _positive_int("finetune.batch_size", self.batch_size)
        if self.eval_every is not None:
            _positive_int("finetune.eval_every", self.eval_every)


@dataclass
class RewriteConfig:
    """Arguments of :func:`surgery.rewrite_inputs`: a built-in rewrite by ``name`` (cast,
    normalize, resize, channels_last, clamp, add_noise, identity) with its ``kwargs``, or an
    importable ``pkg.module.callable`` taking ``(args, kwargs)``; ``select`` = null rewrites the
    root model's inputs."""

    name: str = "identity"
    kwargs: dict[str, Any] = field(default_factory=dict)
    select: Any = None
    exclude: Any = None


DRIFT_RANGES = {
    "min_cosine": (-1.0, 1.0),
    "min_sqnr_db": (-math.inf, math.inf),
    "min_top1_agreement": (0.0, 1.0),
    "max_abs": (0.0, math.inf),
    "max_accuracy_drop": (0.0, 100.0),
}


@dataclass
class DriftThresholds:
    """Bounds the drift check enforces between the original and the modified model."""

    min_cosine: float | None = None
    min_sqnr_db: float | None = None
    min_top1_agreement: float | None = None
    max_abs: float | None = None
    max_accuracy_drop: float | None = None  # in points (percent), with labelled data

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
    """Round-trip checks: which run (all five by default) and the drift bounds."""

    enabled: list[str] = field(default_factory=lambda: ["identity", "restore", "bake", "save_load", "drift"])
    drift: DriftThresholds = field(default_factory=DriftThresholds)
    per_layer: bool = True

    def __post_init__(self) -> None:
        for name in self.enabled:
            _one_of("checks.enabled", name, ("identity", "restore", "bake", "save_load", "drift"))


@dataclass
class OutputConfig:
    """What the run writes into its output folder."""

    checkpoint: str = "safetensors"
    plots: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        _one_of("output.checkpoint", self.checkpoint, CHECKPOINT_FORMATS)


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
        _one_of("build[].kind", self.kind, BUILD_KINDS)
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
                _one_of(f"objective.{key}", name, tuple(OBJECTIVE_METRICS))
        if not math.isfinite(self.penalty) or self.penalty <= 0:
            raise ConfigError("objective.penalty", self.penalty, "must be a positive number")


@dataclass
class RunConfig:
    """One run of a recipe: build ``model`` (with ``build`` rules), apply ``steps`` in order,
    check, report, export."""

    recipe: str = "custom"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    build: list[BuildRuleConfig] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    prune: PruneConfig | None = None
    quantize: QuantizeConfig | None = None
    rewrite: RewriteConfig | None = None
    finetune: FinetuneConfig | None = None
    shrink: ShrinkConfig | None = None
    inspect: bool = False
    sensitivity: SensitivityConfig | None = None  # per-layer sensitivity table and plan (recipe=sensitivity)
    objective: ObjectiveConfig | None = None  # what a search (hydra/sweeper=optuna) optimises
    select_only: bool = False  # dry run: print what each step selects and skips; change and write nothing
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        if not self.steps and not self.build and not self.inspect and self.sensitivity is None:
            raise ConfigError(
                "steps",
                self.steps,
                f"must list at least one of {', '.join(STEPS)} (or the recipe must have build: rules)",
            )
        for index, step in enumerate(self.steps):
            _one_of("steps", step, STEPS)
            if step in self.steps[:index]:
                raise ConfigError(
                    "steps", self.steps, f"lists '{step}' twice; each step runs once, with its '{step}:' settings"
                )
            if getattr(self, step) is None:
                raise ConfigError(step, None, f"step '{step}' is listed in steps but has no '{step}:' settings")
        if self.objective is not None:
            needs = {
                name: OBJECTIVE_METRICS[name][0].split(".")[0]
                for name in [self.objective.maximize, self.objective.minimize, *self.objective.subject_to]
                if name
            }
            for name, part in needs.items():
                if (
                    part == "accuracy"
                    and self.data.kind not in LABELLED_KINDS
                    or part == "perplexity"
                    and self.data.kind != "tinylm"
                ):
                    raise ConfigError(
                        "objective",
                        name,
                        f"needs {'labelled' if part == 'accuracy' else 'tinylm'} "
                        f"data and data.kind is {self.data.kind!r}",
                    )
        if "finetune" in self.steps and self.data.kind not in LABELLED_KINDS:
            raise ConfigError(
                "finetune",
                NO_VALUE,
                f"needs labelled training data and data.kind is "
                f"{self.data.kind!r}; use data=digits, mnist1d, tinylm or imagefolder",
            )


INT64 = (-(1 << 63), (1 << 63) - 1)


def load_config(cfg: DictConfig | dict) -> RunConfig:
    """Validate a composed YAML config against :class:`RunConfig` and return the dataclass.

    Interpolations (``${...}``) are resolved first; every integer must fit in 64 bits.

    Raises:
        ConfigError: naming the first offending field, its value and what is allowed.
    """
    try:
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        _check_integers(cfg, "")
        cfg = {"sensitivity": None, "objective": None, **cfg}  # typed by the schema; absent = not used
        schema = OmegaConf.structured(
            RunConfig(
                steps=["prune"],
                prune=PruneConfig(),
                quantize=QuantizeConfig(activations=QuantSettings()),
                rewrite=RewriteConfig(),
                finetune=FinetuneConfig(),
                shrink=ShrinkConfig(),
                sensitivity=SensitivityConfig(),
                objective=ObjectiveConfig(maximize="sparsity"),
            )
        )
        merged = OmegaConf.merge(schema, cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        cause = err.__cause__ if isinstance(err.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        key = getattr(err, "full_key", None) or "config"
        message = " ".join(str(err).splitlines()[0].split()) if str(err) else type(err).__name__
        if isinstance(err, ConfigKeyError):
            raise ConfigError(key, NO_VALUE, f"not a setting here ({message})") from None
        if isinstance(err, InterpolationResolutionError):
            raise ConfigError(key, NO_VALUE, f"cannot be resolved: {message}") from None
        raise ConfigError(key, _value_of(err), message) from None


def _check_integers(value: Any, key: str) -> None:
    """Refuse integers outside 64 bits (seeds, counts, amounts typed as huge integers) by name."""
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        raise ConfigError(
            key,
            f"a {len(str(abs(value)))}-digit integer",
            f"is out of range: numbers must fit in 64 bits ([{INT64[0]}, {INT64[1]}])",
        )
    if isinstance(value, dict):
        for name, item in value.items():
            _check_integers(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_integers(item, f"{key}.{index}")


def _value_of(err: OmegaConfBaseException) -> object:
    value = getattr(err, "value", None)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
