"""auto-round 0.16's AutoRound on a tiny Llama, run in its own virtual environment by
``test_autoround.py``::

    benchmarks/.venv-auto_round/bin/python tests/ops/quantization/methods/autoround_peer.py IN OUT

made by the benchmarks on first use (``benchmarks/peer_venvs.py``: ``torch==2.14.1
auto-round==0.16.1``; ``bench_calibrated.py --llama --rows AutoRound`` makes it).

``IN`` is a ``torch.save`` of ``{"config": LlamaConfig kwargs, "state": state dict, "samples":
[(1, seq) token ids], "bits", "group_size", "iters", "sym" (optional: int_sym), "scheme"
(optional: ``MXFP4`` or ``NVFP4`` instead of bits and group size)}``; ``OUT``
receives, for every quantized Linear, ``{name: {"weight", "scale", "zp"}}``. Float32 scales and
no autocast, so the two are computed alike.
"""

from __future__ import annotations

import sys

import torch
import transformers
from auto_round import AutoRound

FLOAT_BLOCKS = {"MXFP4": 32, "NVFP4": 16}


class Tokens:
    """A stand-in tokenizer: the calibration samples are token ids already."""

    pad_token, pad_token_id = None, -1  # no padding among the samples (no trailing repeats either)
    eos_token_id = 0


def main(source: str, target: str) -> None:
    given = torch.load(source)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**given["config"])).eval()
    model.load_state_dict(given["state"])
    samples = given["samples"]
    scheme = given.get("scheme")  # "MXFP4" or "NVFP4": its floating-point weights, activations float
    if not scheme:
        grid = {"bits": given["bits"], "group_size": given["group_size"]}
    else:  # spelled out: scheme="NVFP4" keeps its 4-bit activations whatever act_bits says (0.16.1)
        grid = {"bits": 4, "group_size": FLOAT_BLOCKS[scheme], "data_type": scheme[:2].lower() + "_fp", "act_bits": 16}
    tuner = AutoRound(
        model,
        tokenizer=Tokens(),
        **grid,
        sym=given.get("sym", False) if not scheme else True,
        dataset=samples,
        nsamples=len(samples),
        seqlen=samples[0].shape[1],
        iters=given["iters"],
        batch_size=8,
        scale_dtype="fp32",
        amp=False,
        device_map="cpu",
        enable_torch_compile=False,
    )
    tuner.quantize()
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and getattr(module, "scale", None) is not None:
            found[name] = {"weight": module.weight.detach().clone(), "scale": module.scale, "zp": module.zp}
    torch.save(found, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
