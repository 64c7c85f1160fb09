"""auto-round 0.16's AutoRound on a shipped model (the tiny Llama or Qwen3), in auto-round's own
virtual environment (made by ``peer_venvs.py``): run by ``bench_calibrated.py --llama``, as
``llmcompressor_quality.py`` runs llm-compressor.

Usage (by the benchmark)::

    benchmarks/.venv-auto_round/bin/python benchmarks/autoround_quality.py FOLDER DATA SCHEME

``DATA`` is the benchmark's ``torch.save`` of ``{"calibration": int64 (n, 128), "inputs": ...,
"targets": ...}``; every calibration window is one sample. The settings are those
``tests/ops/quantization/methods/autoround_peer.py`` checks bit for bit against surgery's
``method="autoround"``: groups of 128, 200 iterations, a batch of 8 samples, seed 42 (its
default), float32 scales, no autocast, no compile, the last position of each sample left out.
``SCHEME`` is ``wBITS,sym=S`` with ``S`` ``1`` for auto-round's ``int_sym`` grid (its own full
range, not surgery's) or ``0`` for ``int_asym`` (the grid surgery's affine rows use), optionally
``,group_size=G`` (``w2,sym=1,group_size=64`` is its ``W2A16G64``) and ``,awq=1`` (its AWQ first:
``alg_configs="awq,auto_round"``, smoothing only, its default; with ``,clip=1`` its clipping search
applied too, with ``,clip=init`` that clipping as AutoRound's starting range, ``clip_as_init``); or ``nvfp4`` / ``mxfp4``: its ``nv_fp`` / ``mx_fp`` 4-bit
weights in blocks of 16 / 32 with activations left float (``act_bits=16``; its ``scheme="NVFP4"``
would keep 4-bit activations whatever ``act_bits`` says, measured in 0.16.1). The last line printed is
``{"perplexity": ..., "seconds": ...}``: held-out perplexity of the model as ``quantize()``
leaves it (its Linear weights rounded in place), and the wall time of the tuning.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from peer_perplexity import held_out_perplexity  # beside this script

GROUP_SIZE = 128
FLOAT_SCHEMES = {"nvfp4": 16, "mxfp4": 32}  # block sizes
ITERATIONS = 200
BATCH = 8


class Tokens:
    """A stand-in tokenizer: the calibration samples are token ids already."""

    pad_token, pad_token_id = None, -1  # no padding among the windows (and no guessing it from repeats)
    eos_token_id = 0


def settings(scheme: str) -> dict:
    """AutoRound's keyword arguments for the grid ``scheme`` names."""
    name, *pairs = scheme.split(",")
    options = dict(pair.split("=", 1) for pair in pairs)
    if name in FLOAT_SCHEMES:  # spelled out: scheme="NVFP4" quantizes activations to 4 bits whatever act_bits says
        return {"bits": 4, "group_size": FLOAT_SCHEMES[name], "data_type": name[:2] + "_fp", "act_bits": 16}
    found = {
        "bits": int(name[1:]),
        "group_size": int(options.get("group_size", GROUP_SIZE)),
        "sym": options["sym"] == "1",
    }
    if options.get("awq") == "1" and "clip" not in options:  # its AWQ pre-processing (smoothing only), then AutoRound
        found["alg_configs"] = "awq,auto_round"
    elif options.get("awq") == "1":  # with its clipping search: applied (clip=1) or AutoRound's start (clip=init)
        from auto_round.algorithms.transforms.awq.config import AWQConfig

        awq = AWQConfig(apply_clip=True, clip_as_init=options["clip"] == "init")
        found["alg_configs"] = [awq, "auto_round"]
    return found


def main() -> None:
    """Tune the model in FOLDER on DATA's calibration windows and print its held-out perplexity."""
    import transformers
    from auto_round import AutoRound

    folder, data_file, scheme = sys.argv[1:4]
    torch.set_num_threads(1)
    data = torch.load(data_file, weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    samples = [row.unsqueeze(0) for row in data["calibration"]]
    start = time.perf_counter()
    tuner = AutoRound(
        model,
        tokenizer=Tokens(),
        **settings(scheme),
        dataset=samples,
        nsamples=len(samples),
        seqlen=samples[0].shape[1],
        iters=ITERATIONS,
        batch_size=BATCH,
        scale_dtype="fp32",
        amp=False,
        device_map="cpu",
        enable_torch_compile=False,
    )
    tuner.quantize()
    seconds = time.perf_counter() - start
    print(json.dumps({"perplexity": held_out_perplexity(model, data), "seconds": seconds}))


if __name__ == "__main__":
    main()
