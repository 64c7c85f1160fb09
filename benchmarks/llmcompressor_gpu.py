"""llm-compressor's GPTQModifier (W4, groups of 128) on a GPU, for ``bench_gpu.py``: the model in
FOLDER, in bfloat16 on the GPU, calibrated on ``FOLDER/calibration.pt`` (int64 (sequences,
length)) with its sequential pipeline. Run with llm-compressor 0.14 on the Python path (its
wheels installed apart, ``scripts/gpu_wheels.sh``); the last line printed is
``{"seconds": ..., "peak_gib": ...}``.

Usage (by the benchmark)::

    PYTHONPATH=PEER python benchmarks/llmcompressor_gpu.py FOLDER
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from tokenizers import Tokenizer, models

    folder = Path(sys.argv[1])
    calibration = torch.load(folder / "calibration.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    dataset = Dataset.from_dict(
        {"input_ids": calibration.tolist(), "attention_mask": [[1] * calibration.shape[1]] * len(calibration)}
    )
    words = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))  # the batches come tokenized
    processor = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<unk>")
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    oneshot(
        model=model,
        processor=processor,
        dataset=dataset,
        recipe=[GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])],
        num_calibration_samples=len(calibration),
        max_seq_length=calibration.shape[1],
        pipeline="sequential",
    )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}))


if __name__ == "__main__":
    main()
