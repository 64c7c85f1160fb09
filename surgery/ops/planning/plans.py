"""A plan as a file: each selected layer's choice (and each attention module's KV-cache choice),
bytes and score, and the totals; saved as JSON or YAML, loaded back, applied in one run (one
verb call per choice) with one handle."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from surgery.core.checkpoints import refuse_existing, write_atomically
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle, HandleGroup, restored_on_error
from surgery.ops.planning.choices import DENSE_BITS, choice_named

YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class PlanRow:
    """One layer of a plan: the choice, the weight's shape, the bytes it stores and the score;
    for ``target="kv_cache"`` an attention module's cache, its shape (values per token, tokens)."""

    layer: str
    choice: str
    shape: tuple[int, int]
    bytes: int
    score: float
    target: str = "weight"


@dataclass
class Plan:
    """What :func:`surgery.plan` chose (see :mod:`surgery.ops.planning.planning`)."""

    rows: list[PlanRow]
    budget: int  # bytes
    estimate: str  # "gradient" or "drift"
    solver: str  # "exact" or "lagrangian"
    method: str = "rtn"  # the weight method of the integer choices
    choices: list[str] = field(default_factory=list)
    kv_tokens: int | None = None  # the tokens a KV cache was counted at, when the plan chose cache dtypes

    @property
    def weights(self) -> int:
        return sum(r.shape[0] * r.shape[1] for r in self.rows if r.target == "weight")

    @property
    def total_bytes(self) -> int:
        """The weights' bytes and, when planned, the KV cache's at ``kv_tokens``."""
        return sum(r.bytes for r in self.rows)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(r.bytes for r in self.rows if r.target == "kv_cache")

    @property
    def bits_per_weight(self) -> float:
        """Of the planned weights alone (the cache's bytes are not weights)."""
        return 8 * (self.total_bytes - self.kv_cache_bytes) / max(self.weights, 1)

    @property
    def score(self) -> float:
        return sum(r.score for r in self.rows)

    def counts(self) -> dict[str, int]:
        """How many layers take each choice."""
        found: dict[str, int] = {}
        for row in self.rows:
            found[row.choice] = found.get(row.choice, 0) + 1
        return found

    def as_dict(self) -> dict[str, Any]:
        """The plan and its totals, JSON-serialisable."""
        totals = {
            "total_bytes": self.total_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "weights": self.weights,
            "bits_per_weight": self.bits_per_weight,
        }
        head = {k: v for k, v in asdict(self).items() if k != "rows"}
        return {
            **head,
            **totals,
            "score": self.score,
            "counts": self.counts(),
            "layers": [asdict(r) for r in self.rows],
        }

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the plan atomically: YAML for a ``.yaml``/``.yml`` path, JSON otherwise; an existing
        file raises :class:`~surgery.core.errors.OutputExistsError` unless ``overwrite``."""
        path = Path(path)
        if path.is_dir():
            raise ConfigError("plan.save.path", str(path), "is a folder; give the plan's file (.json, .yaml or .yml)")
        refuse_existing([path], overwrite)
        data = self.as_dict()
        if path.suffix in YAML_SUFFIXES:  # block YAML whose values are JSON (valid YAML, read without PyYAML)
            lines = [f"{k}: {json.dumps(v)}" for k, v in data.items() if k != "layers"]
            lines += ["layers:", *(f"  - {json.dumps(row)}" for row in data["layers"])]
            text = "\n".join(lines) + "\n"
        else:
            text = json.dumps(data, indent=1) + "\n"
        write_atomically(path, lambda tmp: tmp.write_text(text))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """A plan written by :meth:`save` (JSON or YAML)."""
        path = Path(path)
        try:
            data = _read_yaml(path.read_text()) if path.suffix in YAML_SUFFIXES else json.loads(path.read_text())
            rows = [
                PlanRow(
                    r["layer"],
                    r["choice"],
                    tuple(r["shape"]),
                    int(r["bytes"]),
                    float(r["score"]),
                    r.get("target", "weight"),
                )
                for r in data["layers"]
            ]
            tokens = data.get("kv_tokens")
            return cls(
                rows,
                int(data["budget"]),
                data["estimate"],
                data["solver"],
                data["method"],
                list(data["choices"]),
                None if tokens is None else int(tokens),
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError("plan.file", str(path), f"is not a plan written by Plan.save ({err})") from None

    def apply(self, model: nn.Module, *, calibration: Any = None) -> Handle:
        """Apply every layer's choice, one verb call per choice (``dense`` layers untouched);
        the handle's ``restore()`` gives back every weight bit for bit. On an error, whatever
        was applied is restored before it propagates."""
        by_choice: dict[str, list[str]] = {}
        for row in self.rows:
            if choice_named(row.choice, "plan.layers.choice").target != row.target:
                raise ConfigError("plan.layers.choice", row.choice, f"is no choice for a {row.target} ({row.layer})")
            model.get_submodule(row.layer)  # an AttributeError names a layer this model lacks
            by_choice.setdefault(row.choice, []).append(row.layer)
        handles: list[Handle] = []
        with restored_on_error():
            for name, layers in by_choice.items():
                if name != "dense":
                    handles.append(choice_named(name).apply(model, layers, calibration, self.method))
        group = HandleGroup(handles, model) if handles else Handle("plan", model)
        group.kind = "plan"
        return group

    def summary(self) -> str:
        """A printable table: each layer's choice, bits per weight and score, and the totals."""
        width = max([len(r.layer) for r in self.rows] + [5])
        lines = [f"{'layer':<{width}}  {'choice':<8} {'bpw':>6} {'bytes':>10} {'score':>10}"]
        for r in self.rows:
            bpw = 8 * r.bytes / (r.shape[0] * r.shape[1])
            lines.append(f"{r.layer:<{width}}  {r.choice:<8} {bpw:>6.3f} {r.bytes:>10,} {r.score:>10.4g}")
        cache = f"; KV cache {self.kv_cache_bytes:,} bytes at {self.kv_tokens:,} tokens" if self.kv_tokens else ""
        lines.append(
            f"{'total':<{width}}  {'':<8} {self.bits_per_weight:>6.3f} {self.total_bytes:>10,} {self.score:>10.4g}"
            f"  (budget {self.budget:,} bytes{cache}; {self.estimate} estimate, {self.solver} solve; "
            f"dense counts {DENSE_BITS} bits)"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _read_yaml(text: str) -> dict[str, Any]:
    """A YAML plan: through PyYAML when installed, else the JSON-valued lines :meth:`Plan.save` writes."""
    try:
        import yaml
    except ImportError:
        data: dict[str, Any] = {"layers": []}
        for line in text.splitlines():
            if line.startswith("  - "):
                data["layers"].append(json.loads(line[4:]))
            elif line.strip() and not line.startswith("layers:"):
                key, _, value = line.partition(": ")
                data[key] = json.loads(value)
        return data
    return yaml.safe_load(text)
