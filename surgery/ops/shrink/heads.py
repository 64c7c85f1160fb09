"""How attention modules lay out their heads, so :func:`surgery.shrink` can remove whole heads.

An attention module computes ``heads × head_dim`` channels with its query/key/value
projections, mixes them per head (reshapes, softmax, matmuls that the channel trace cannot
follow) and merges them back for an output projection. A :class:`HeadLayout` names those
projections and the attributes that hold the head count, so the trace treats the module as
one unit: the rows of every head are coupled across the projections, and removing a head
removes its rows, the output projection's matching columns, and updates the attributes.

Built-in layouts cover Hugging Face BERT-style (``BertSelfAttention``), ViT and Llama-style
attention (grouped key/value heads included) and timm's ``Attention``; users add their own
with :func:`register_heads`, the same door.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from torch import nn

from surgery.core.errors import ConfigError, ConfigTypeError


@dataclass(frozen=True)
class HeadLayout:
    """Where an attention module keeps its heads.

    Attributes:
        projections: child Linear layers whose output rows are ``(head, head_dim)`` blocks
            (query, key, value). A packed projection (timm's ``qkv``) is one name with ``packed=3``.
        head_dim: the attribute holding the size of one head (kept as it is).
        heads: attributes holding a head count, each updated to the heads kept: for one
            projection's count name it as ``{attribute: projection}`` (default: the first).
        output: the child Linear reading the merged heads, or ``None`` when the module returns
            the merged heads and a layer outside reads them (BERT's ``BertSelfOutput.dense``).
        derived: attributes recomputed as ``heads × head_dim`` of a projection (``all_head_size``).
        packed: how many projections one packed layer holds (its rows: ``packed × heads × head_dim``).
    """

    projections: tuple[str, ...]
    head_dim: str
    heads: dict[str, str] = field(default_factory=dict)
    output: str | None = None
    derived: dict[str, str] = field(default_factory=dict)
    packed: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.projections, list):
            object.__setattr__(self, "projections", tuple(self.projections))
        if (
            not isinstance(self.projections, tuple)
            or not self.projections
            or not all(isinstance(p, str) for p in self.projections)
        ):
            raise ConfigTypeError(
                "HeadLayout.projections",
                self.projections,
                "must be a tuple of child names, e.g. ('query', 'key', 'value') or ('qkv',) with packed=3",
            )
        if not isinstance(self.head_dim, str):
            raise ConfigTypeError("HeadLayout.head_dim", self.head_dim, "must be the name of an attribute")
        for name in ("heads", "derived"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and v in self.projections for k, v in value.items()
            ):
                raise ConfigTypeError(
                    f"HeadLayout.{name}",
                    value,
                    f"must map attribute names to one of the projections {self.projections}",
                )
        if self.output is not None and not isinstance(self.output, str):
            raise ConfigTypeError("HeadLayout.output", self.output, "must be a child name or None")
        if (
            isinstance(self.packed, bool)
            or not isinstance(self.packed, int)
            or self.packed < 1
            or (self.packed > 1 and len(self.projections) != 1)
        ):
            raise ConfigError("HeadLayout.packed", self.packed, "must be 1, or > 1 with exactly one projection")


_lock = threading.Lock()
_layouts: list[tuple[type | str, HeadLayout]] = []


def register_heads(cls: type | str, layout: HeadLayout) -> HeadLayout:
    """Declare how ``cls`` (a class, or its dotted ``"module.ClassName"`` path so the package
    need not be imported) lays out its heads. A later registration of the same class wins.

    Example:
        >>> surgery.register_heads(MyAttention, surgery.HeadLayout(("q", "k", "v"), "head_dim",
        ...                        heads={"n_heads": "q"}, output="out"))
    """
    if not isinstance(cls, (type, str)):
        raise ConfigTypeError("register_heads.cls", cls, "must be a class or its dotted path")
    if not isinstance(layout, HeadLayout):
        raise ConfigTypeError("register_heads.layout", layout, "must be a surgery.HeadLayout")
    with _lock:
        _layouts[:] = [(c, lay) for c, lay in _layouts if c != cls]
        _layouts.append((cls, layout))
    return layout


def unregister_heads(cls: type | str) -> None:
    """Forget the layout of ``cls`` (a no-op when there is none)."""
    with _lock:
        _layouts[:] = [(c, lay) for c, lay in _layouts if c != cls]


def layout_of(module: nn.Module) -> HeadLayout | None:
    """The registered layout for ``module``'s class (or a base class), or ``None``."""
    paths = {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}
    with _lock:
        for cls, layout in reversed(_layouts):
            if (isinstance(cls, type) and isinstance(module, cls)) or (isinstance(cls, str) and cls in paths):
                return layout
    return None


def head_counts(module: nn.Module, layout: HeadLayout) -> dict[str, int] | None:
    """The number of heads each projection holds, or ``None`` when the module does not match
    its layout (missing children or attributes, rows that are not whole heads)."""
    head_dim = getattr(module, layout.head_dim, None)
    if not isinstance(head_dim, int) or head_dim < 1:
        return None
    counts: dict[str, int] = {}
    for name in layout.projections + ((layout.output,) if layout.output else ()):
        child = getattr(module, name, None)
        if not isinstance(child, nn.Linear):
            return None
    for name in layout.projections:
        rows = getattr(module, name).out_features
        if rows % (head_dim * layout.packed):
            return None
        counts[name] = rows // (head_dim * layout.packed)
    units = min(counts.values())
    if any(count % units for count in counts.values()):
        return None
    for attribute, projection in layout.heads.items():
        if getattr(module, attribute, None) != counts.get(projection):
            return None
    for attribute, projection in layout.derived.items():
        if getattr(module, attribute, None) != counts.get(projection, 0) * head_dim:
            return None
    return counts


BERT_SELF_ATTENTION = HeadLayout(
    ("query", "key", "value"),
    "attention_head_size",
    heads={"num_attention_heads": "query"},
    derived={"all_head_size": "query"},
)
register_heads("transformers.models.bert.modeling_bert.BertSelfAttention", BERT_SELF_ATTENTION)
register_heads("transformers.models.roberta.modeling_roberta.RobertaSelfAttention", BERT_SELF_ATTENTION)
register_heads(
    "transformers.models.vit.modeling_vit.ViTAttention",
    HeadLayout(("q_proj", "k_proj", "v_proj"), "head_dim", heads={"num_attention_heads": "q_proj"}, output="o_proj"),
)
LLAMA_ATTENTION = HeadLayout(("q_proj", "k_proj", "v_proj"), "head_dim", output="o_proj")
for _path in (  # transformers' own copies of Llama's attention (modular code: no common base class)
    "llama.modeling_llama.LlamaAttention",
    "mixtral.modeling_mixtral.MixtralAttention",
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeAttention",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention",
    "phimoe.modeling_phimoe.PhimoeAttention",
):
    register_heads(f"transformers.models.{_path}", LLAMA_ATTENTION)
register_heads(
    "timm.layers.attention.Attention",
    HeadLayout(("qkv",), "head_dim", heads={"num_heads": "qkv"}, output="proj", derived={"attn_dim": "qkv"}, packed=3),
)
