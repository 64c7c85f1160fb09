"""The decoder families of docs/models.md's coverage table: one tiny seeded model per family, every
verb and export run on it, and the table of what each did (``ok``, ``refused: ...`` or ``BUG: ...``).

Read by ``tests/test_family_coverage.py`` (the table in the docs must equal the one built here) and
by ``scripts/family_coverage.py`` (prints the table, or rewrites it in docs/models.md).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import surgery
from surgery import GridSpec
from tests.support import tiny_moe

DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"
START, END = "<!-- family-coverage:start -->", "<!-- family-coverage:end -->"
REFUSAL_CHARS = 70
VOCAB, HIDDEN, LAYERS = 128, 32, 2
SMALL = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, vocab_size=VOCAB)
LLAMA_LIKE = dict(SMALL, intermediate_size=2 * HIDDEN, num_key_value_heads=2, max_position_embeddings=64)


def _dense_configs() -> dict[str, Callable[[], Any]]:
    """The config of each dense family, by model type (transformers 5.24's classes)."""
    import transformers as t

    return {
        "llama": lambda: t.LlamaConfig(**LLAMA_LIKE),
        "mistral": lambda: t.MistralConfig(**LLAMA_LIKE),
        "qwen2": lambda: t.Qwen2Config(**LLAMA_LIKE),
        "qwen3": lambda: t.Qwen3Config(**LLAMA_LIKE, head_dim=8),
        "gemma2": lambda: t.Gemma2Config(**LLAMA_LIKE, head_dim=8, query_pre_attn_scalar=8, sliding_window=8),
        "gemma3": lambda: t.Gemma3TextConfig(**LLAMA_LIKE, head_dim=8, query_pre_attn_scalar=8, sliding_window=8),
        "phi3": lambda: t.Phi3Config(**LLAMA_LIKE, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "olmo2": lambda: t.Olmo2Config(**LLAMA_LIKE, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gpt2": lambda: t.GPT2Config(
            n_layer=LAYERS, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
        "gpt_neox": lambda: t.GPTNeoXConfig(
            **SMALL, intermediate_size=2 * HIDDEN, max_position_embeddings=64, bos_token_id=0, eos_token_id=0
        ),
        "opt": lambda: t.OPTConfig(
            **SMALL, ffn_dim=2 * HIDDEN, max_position_embeddings=64, word_embed_proj_dim=HIDDEN, pad_token_id=1
        ),
        "falcon": lambda: t.FalconConfig(**SMALL),
    }


MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "phimoe", "olmoe", "gpt_oss", "deepseek_v3")
DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "gpt2", "gpt_neox", "opt", "falcon")
FAMILIES = DENSE + MOE
VERBS = ("prune", "wanda", "rtn", "gptq", "smooth", "awq", "rotate", "kv_cache")
EXPORTS = ("compressed-tensors", "torchao", "onnx")
CELLS = VERBS + EXPORTS


def tiny_decoder(family: str) -> nn.Module:
    """A random 2-layer causal LM of ``family`` (hidden 32, vocabulary 128), seeded, fp32, no cache."""
    import transformers

    if family in MOE:
        model = tiny_moe(family, layers=LAYERS, hidden=HIDDEN)
    else:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_dense_configs()[family]()).eval()
    model.config.use_cache = False
    return model


def token_batches(count: int = 4) -> list[dict[str, torch.Tensor]]:
    """``count`` seeded batches of 2 × 16 token ids."""
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 16), generator=generator)} for _ in range(count)]


def group_share(handle: Any) -> str:
    """`` 0.86``: the share of the parameters the handle changed, where it says."""
    coverage = getattr(handle, "coverage", None)
    return f" {coverage.share:.2f}" if coverage is not None else ""


def _verb(cell: str, model: nn.Module, batches: list) -> Any:
    """Run the verb of ``cell`` on ``model``; its handle."""
    w4 = GridSpec(bits=4, group_size=16)
    quiet = dict(progress=False)
    if cell == "prune":
        return surgery.prune(model, 0.5, **quiet)
    if cell == "wanda":
        return surgery.prune(model, 0.5, method="wanda", calibration=batches, **quiet)
    if cell == "rtn":
        return surgery.quantize(model, weights=w4, **quiet)
    if cell == "gptq":
        return surgery.quantize(
            model, weights=GridSpec(bits=4, group_size=16), method="gptq", calibration=batches, **quiet
        )
    if cell == "smooth":
        return surgery.smooth(model, 0.5, calibration=batches, **quiet)
    if cell == "awq":
        return surgery.awq(model, weights=w4, calibration=batches, **quiet)
    if cell == "rotate":
        return surgery.rotate(model, calibration=batches, **quiet)
    return surgery.quantize_kv_cache(model, calibration=batches, **quiet)


PRESERVING = ("smooth", "rotate")  # verbs that promise the same outputs up to float rounding
PRESERVED = 1e-3  # their largest move, relative to the largest output


@torch.no_grad()
def _logits(model: nn.Module, batch: dict) -> torch.Tensor:
    """``model``'s logits on ``batch``."""
    return model(**batch).logits.detach().clone()


def _apply(cell: str, model: nn.Module, batches: list) -> str:
    """Run the verb of ``cell`` and restore it; ``ok`` and the share it changed, or a BUG when a
    verb that promises the same outputs moved them."""
    before = _logits(model, batches[0]) if cell in PRESERVING else None
    handle = _verb(cell, model, batches)
    try:
        if before is not None:
            moved = ((_logits(model, batches[0]) - before).abs().max() / before.abs().max()).item()
            if not moved <= PRESERVED:
                return f"BUG: outputs moved by {moved:.2g} of their largest"
        return f"ok{group_share(handle)}"
    finally:
        handle.restore()


def _export(cell: str, model: nn.Module, batches: list, folder: Path) -> str:
    """Quantize ``model`` for the format of ``cell``, export it and restore it; ``ok`` and what the
    export left out."""
    grids = {
        "compressed-tensors": GridSpec(bits=4, symmetric=True, group_size=16),
        "onnx": GridSpec(bits=8, symmetric=True, per_channel=True),
    }
    paths = {"compressed-tensors": folder / "model", "torchao": folder / "model.pt", "onnx": folder / "model.onnx"}
    with surgery.quantize(model, weights=grids.get(cell, grids["onnx"]), progress=False) as handle:
        record = surgery.export(handle, paths[cell], format=cell, inputs=batches[:1])
    return f"ok, left out {len(record.left_out)}" if record.left_out else "ok"


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every tensor of ``model``'s state dict."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _changed(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The state-dict entries of ``model`` that are not, bit for bit, those of ``before``."""
    after = model.state_dict()
    names = sorted(set(before) ^ set(after))
    for name in before.keys() & after.keys():
        a, b = before[name], after[name].detach()
        if (
            a.dtype != b.dtype
            or a.shape != b.shape
            or not torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        ):
            names.append(name)
    return names


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warnings, no log records below ERROR and nothing printed inside the block (torch.onnx
    prints whole graphs when torch.export fails)."""
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.disable(level)


def one_line(error: BaseException) -> str:
    """The first line of ``error``'s message without the value it quotes (``FIELD: what is
    allowed``: the reason, which a long layer name would push out), cut to the table's width."""
    text = f"{error.field}: {error.allowed}" if isinstance(error, surgery.ConfigError) else str(error)
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip()
    text = text.splitlines()[0] if text else type(error).__name__
    text = text.replace("|", "/").replace("`", "'")
    return text if len(text) <= REFUSAL_CHARS else text[: REFUSAL_CHARS - 1].rstrip() + "…"


def run_cell(family: str, cell: str, details: dict | None = None) -> str:
    """What ``cell`` (a verb or an export) does on ``family``: ``ok`` (with the share of the
    parameters it changed, where the handle says) when it returns and ``restore()`` brings every
    tensor back bit for bit, ``refused: <its one line>`` for a surgery error, ``BUG: ...`` else.
    ``details``, when given, gets the whole error text under ``(family, cell)``."""
    model, batches = tiny_decoder(family), token_batches()
    before = _state(model)
    try:
        with _quiet(), tempfile.TemporaryDirectory() as folder, surgery.every_expert_calibrated():
            outcome = _export(cell, model, batches, Path(folder)) if cell in EXPORTS else _apply(cell, model, batches)
    except surgery.SurgeryError as error:
        if details is not None:
            details[family, cell] = f"{type(error).__name__}: {error}"
        changed = _changed(model, before)
        if changed:
            return f"BUG: refused, left {len(changed)} tensors changed"
        kind = "parity fails" if isinstance(error, surgery.ExportParityError) else "refused"
        return f"{kind}: {one_line(error)}"
    except Exception as error:  # noqa: BLE001 - a traceback in a cell is what the table reports
        if details is not None:
            import traceback

            details[family, cell] = "".join(traceback.format_exception(error))
        return f"BUG: {type(error).__name__}"
    changed = _changed(model, before)
    return f"BUG: restore left {len(changed)} tensors changed" if changed else outcome


def coverage(families: tuple[str, ...] = FAMILIES, cells: tuple[str, ...] = CELLS, details: dict | None = None) -> dict:
    """``{(family, cell): outcome}`` for every family and cell given."""
    return {(family, cell): run_cell(family, cell, details) for family in families for cell in cells}


def render(table: dict) -> str:
    """The markdown table of ``table``: a row per family, a column per cell."""
    families = list(dict.fromkeys(family for family, _ in table))
    cells = list(dict.fromkeys(cell for _, cell in table))
    lines = ["| family | " + " | ".join(cells) + " |", "| --- " * (len(cells) + 1) + "|"]
    lines += ["| " + " | ".join([family] + [table[family, cell] for cell in cells]) + " |" for family in families]
    return "\n".join(lines)


def documented() -> dict:
    """``{(family, cell): outcome}`` as the table in docs/models.md says."""
    text = DOCS.read_text()
    block = text[text.index(START) + len(START) : text.index(END)]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    split = lambda line: [part.strip() for part in re.split(r"(?<!\\)\|", line.strip())[1:-1]]  # noqa: E731
    header = split(rows[0])[1:]
    return {(row[0], cell): value for row in map(split, rows[2:]) for cell, value in zip(header, row[1:])}


def rewrite_docs(table: dict) -> None:
    """Put ``table`` between the markers of docs/models.md."""
    text = DOCS.read_text()
    head, tail = text[: text.index(START) + len(START)], text[text.index(END) :]
    DOCS.write_text(f"{head}\n{render(table)}\n{tail}")
