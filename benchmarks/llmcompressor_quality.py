"""llm-compressor's implementation of one method on the shipped tiny Llama, in llm-compressor's
own virtual environment (it pins torch <= 2.14.0): run by ``bench_calibrated.py --llama``.

Usage (by the benchmark)::

    benchmarks/.venv-llmcompressor/bin/python benchmarks/llmcompressor_quality.py FOLDER DATA METHOD

``METHOD`` is a name and a setting (``gptq:w3``), optionally followed by ``,key=value`` options
for the weights' ``QuantizationArgs`` (``gptq:w3,observer=mse``, ``rtn:w2,group_size=64``;
``actorder=none`` turns GPTQModifier's default activation order, ``"static"`` = ``"weight"``,
off). ``rtn:nvfp4``, ``gptq:mxfp4``: the preset weight-only schemes ``NVFP4A16``, ``MXFP4A16``.
``DATA`` is a ``torch.save`` of ``{"calibration": int64 (n, 128), "inputs": ..., "targets": ...}``
made by the benchmark from the tiny-LM corpus; the last line printed is
``{"perplexity": ..., "seconds": ...}`` (held-out perplexity of the model as llm-compressor
leaves it after ``oneshot``: fake-quantized or pruned in place).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch
from peer_perplexity import held_out_perplexity  # beside this script

FLOAT_SCHEMES = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}  # llm-compressor 0.14's weight-only FP4 presets
HEAD = ["re:.*lm_head"]  # llm-compressor 0.14's pruning modifiers do not match a bare "lm_head"


def weights(bits: int, symmetric: bool, options: dict[str, str]) -> dict:
    """One config group: every Linear's weights on a grid with a scale per 128 inputs (or ``group_size``)."""
    extra = {  # actorder is GPTQModifier's own; numbers (group_size=64) as numbers
        key: int(value) if value.isdigit() else value for key, value in options.items() if key != "actorder"
    }
    return {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": bits,
                "type": "int",
                "symmetric": symmetric,
                "strategy": "group",
                "group_size": 128,
                **extra,
            },
        }
    }


def recipe(method: str) -> list:
    from llmcompressor.modifiers.pruning import WandaPruningModifier
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SpinQuantModifier

    method, *pairs = method.split(",")
    options = dict(pair.split("=", 1) for pair in pairs)
    name, _, setting = method.partition(":")
    if name in ("rtn", "gptq") and setting in FLOAT_SCHEMES:
        if name == "rtn":
            return [QuantizationModifier(targets="Linear", scheme=FLOAT_SCHEMES[setting], ignore=HEAD)]
        order = {"actorder": None} if options.get("actorder") == "none" else {}
        return [GPTQModifier(targets="Linear", scheme=FLOAT_SCHEMES[setting], ignore=HEAD, **order)]
    if name in ("rtn", "gptq", "awq", "awq-gptq"):
        bits, symmetric = int(setting[1]), name == "rtn" or name == "gptq"
        groups = weights(bits, symmetric, options)
        quantize = GPTQModifier if name.endswith("gptq") else QuantizationModifier
        order = {"actorder": None} if options.get("actorder") == "none" else {}  # None in the group: "static"
        steps = [quantize(config_groups=groups, ignore=HEAD, **order)]
        if name.startswith("awq"):  # the paper's scales (no duo scaling), then the same grid
            steps.insert(0, AWQModifier(duo_scaling=False, offload_device=None))  # its grid is the next modifier's
        return steps
    if name in ("w4a8", "w4a8-rotated", "w4a4", "w4a4-rotated"):
        scheme = "W4A8" if name.startswith("w4a8") else "W4A4"
        steps = [QuantizationModifier(targets="Linear", scheme=scheme, ignore=HEAD)]
        if name.endswith("rotated"):
            steps.insert(0, SpinQuantModifier(rotations=["R1", "R2"], transform_type="hadamard"))
        return steps
    if name == "fp8":
        return [QuantizationModifier(targets="Linear", scheme="FP8", ignore=HEAD)]
    amount, structure = (0.5, "2:4") if setting == "2:4" else (int(setting) / 100, "0:0")
    if name == "sparsegpt":
        return [SparseGPTModifier(sparsity=amount, mask_structure=structure, ignore=HEAD)]
    if name == "wanda":
        return [WandaPruningModifier(sparsity=amount, mask_structure=structure, ignore=HEAD)]
    if name == "owl-wanda":
        return [
            WandaPruningModifier(
                sparsity=amount, mask_structure=structure, ignore=HEAD, sparsity_profile="owl", owl_m=5, owl_lmbda=0.08
            )
        ]
    raise SystemExit(f"unknown method {method!r}")


def main() -> None:
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache
    from tokenizers import Tokenizer, models

    # 0.14's AWQ pins its cached inputs for faster host-to-device copies, unconditionally: on a
    # machine without an accelerator that raises. Pinning changes no value; skip it here.
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    folder, data_file, method = sys.argv[1:4]
    torch.set_num_threads(1)
    data = torch.load(data_file, weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    calibration = data["calibration"]
    dataset = Dataset.from_dict(
        {"input_ids": calibration.tolist(), "attention_mask": [[1] * calibration.shape[1]] * len(calibration)}
    )
    words = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))  # the batches come tokenized
    processor = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<unk>")
    config_folder = tempfile.mkdtemp()
    model.config.save_pretrained(config_folder)
    model.config.name_or_path = config_folder
    start = time.perf_counter()
    oneshot(
        model=model,
        processor=processor,
        dataset=dataset,
        recipe=recipe(method),
        num_calibration_samples=len(calibration),
        max_seq_length=calibration.shape[1],
        pipeline="sequential",
    )
    seconds = time.perf_counter() - start
    print(json.dumps({"perplexity": held_out_perplexity(model, data), "seconds": seconds}))


if __name__ == "__main__":
    main()
