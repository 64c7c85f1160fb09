"""What a verb's attach holds beyond the model: resident growth after ``gc.collect()``, as a
multiple of the bytes of the weights it changes (``bench_scale.py --attach`` runs it).

Rows, each in a fresh child process on one torch thread, the model built and the verb's code
warmed up on a tiny model before the baseline:

- a dense Llama (hidden 1024, 4 layers, float32) and a Qwen3-MoE with 64 experts (hidden 512,
  expert MLP 512, 2 layers, float32), every Linear but ``lm_head`` changed;
- surgery's ``quantize`` W4 (asymmetric, groups of 32) with RTN and with GPTQ (4 sequences of 64
  tokens, every expert calibrated), its originals for ``restore()`` in memory (the default) and
  on disk (``originals="disk"``): the handle stays attached while it is measured;
- llm-compressor 0.14's ``oneshot`` with the same scheme (``QuantizationModifier`` for RTN,
  ``GPTQModifier``), in its own virtual environment: it keeps no originals (nothing to restore),
  its fake-quantized weights and grids in the model.

Nothing here calls ``malloc_trim`` or sets the allocator: a script's user gets what is measured.
"""

from __future__ import annotations

import gc
import time

MODELS = ("dense", "moe")
METHODS = ("rtn", "gptq")
GROUP = 32


def build(kind: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "dense":
        config = transformers.LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
            num_hidden_layers=4, vocab_size=4096, max_position_embeddings=256,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.Qwen3MoeConfig(
        hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=64,
        num_experts_per_tok=4, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, vocab_size=4096, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config).eval()


def token_ids():
    import torch

    return torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(1))


def changed_bytes(model) -> int:
    """The bytes of the weights every row changes: every Linear's (and fused experts') but lm_head's."""
    total = 0
    for name, param in model.named_parameters():
        if name.startswith("lm_head") or param.dim() < 2 or "embed" in name or "norm" in name:
            continue
        total += param.numel() * param.element_size()
    return total


def resident() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def run(model_kind: str, method: str, originals: str) -> dict:
    """One row in this (child) process: ``originals`` is ``memory``, ``disk`` or ``llmcompressor``."""
    import torch

    torch.set_num_threads(1)
    model = build(model_kind)
    ids = token_ids()
    attach = _llm_compressor if originals == "llmcompressor" else _surgery
    attach(torch.nn.Sequential(torch.nn.Linear(64, 64)), method, originals, None, warm_up=True)
    with torch.no_grad():
        model(ids[:1])
    gc.collect()
    base = resident()
    start = time.perf_counter()
    kept = attach(model, method, originals, ids)
    seconds = time.perf_counter() - start
    gc.collect()
    grown = resident() - base
    del kept
    return {"grown": grown, "changed": changed_bytes(model), "seconds": seconds}


def _surgery(model, method: str, originals: str, ids, warm_up: bool = False):
    import surgery

    spec = surgery.GridSpec(bits=4, group_size=GROUP)
    calibration = None if ids is None or method == "rtn" else [{"input_ids": ids[i : i + 1]} for i in range(len(ids))]
    if warm_up:
        calibration = [__import__("torch").randn(2, 64)] if method != "rtn" else None
        surgery.quantize(model, weights=spec, method=method, calibration=calibration, progress=False).restore()
        return None
    with surgery.every_expert_calibrated():
        return surgery.quantize(
            model,
            weights=spec,
            method=method,
            calibration=calibration,
            exclude="lm_head",
            originals=originals,
            progress=False,
        )


def _llm_compressor(model, method: str, originals: str, ids, warm_up: bool = False):
    if warm_up:
        import llmcompressor  # noqa: F401
        import llmcompressor.modifiers.quantization  # noqa: F401

        return None
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    modifier = GPTQModifier if method == "gptq" else QuantizationModifier
    recipe = modifier(config_groups=groups, ignore=["lm_head", "re:.*mlp.gate$"])
    oneshot_on(model, ids, recipe, "sequential" if method == "gptq" else "datafree")
    return model


def oneshot_on(model, ids, recipe, pipeline: str) -> None:
    """llm-compressor's ``oneshot`` with ``recipe`` on ``model``, the token ids as its (tokenized) data set."""
    import tempfile

    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from tokenizers import Tokenizer, models

    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * ids.shape[1]] * len(ids)})
    words = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))  # the batches come tokenized
    folder = tempfile.mkdtemp()  # oneshot reads the model's config back from its name_or_path
    model.config.save_pretrained(folder)
    model.config.name_or_path = folder
    oneshot(
        model=model,
        processor=transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<unk>"),
        dataset=data,
        recipe=recipe,
        num_calibration_samples=len(ids),
        max_seq_length=ids.shape[1],
        pipeline=pipeline,
    )


def table(results: dict[str, dict]) -> str:
    """Resident growth ÷ the changed weights' bytes, and seconds, per row and model."""
    lines = ["| | " + " | ".join(f"{m}: growth ÷ changed bytes | s" for m in MODELS) + " |"]
    lines.append("|" + " --- |" * (2 * len(MODELS) + 1))
    for name, by_model in results.items():
        cells = []
        for m in MODELS:
            row = by_model.get(m)
            cells.append("—|—" if row is None else f"{row['grown'] / row['changed']:.2f}× | {row['seconds']:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
