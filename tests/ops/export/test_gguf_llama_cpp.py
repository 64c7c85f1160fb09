"""llama.cpp itself runs surgery's GGUF files: the shipped tiny Llama and Qwen3 calibrated onto
Q4_0, Q5_0 and Q8_0, their logits from llama-cpp-python (in the benchmark's own environment,
``benchmarks/peer_venvs.py``; skipped when it is absent) against the simulation's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from support import peer_python  # tests/support.py

import surgery
from surgery import GridSpec
from surgery.tasks.tinyllama import load_llama
from surgery.tasks.tinyqwen3 import load_qwen3

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "llama_cpp_runner.py"
MODELS = {"tinyllama": load_llama, "tinyqwen3": load_qwen3}


def llama_cpp_logits(python: Path, model_file: Path, ids: torch.Tensor, tmp: Path) -> np.ndarray:
    (tmp / "ids.json").write_text(json.dumps(ids.tolist()))
    result = subprocess.run(
        [str(python), str(SCRIPT), "logits", str(model_file), str(tmp / "ids.json"), str(tmp / "out.npy")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return np.load(tmp / "out.npy")


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q8_0"])
def test_llama_cpp_computes_the_simulation_s_logits_within_its_activation_rounding(tmp_path, model_name, kind):
    python = peer_python("llama_cpp")
    if python is None:
        pytest.skip(
            "llama-cpp-python is not built: run benchmarks/bench_gguf.py once (it makes benchmarks/.venv-llama_cpp)"
        )
    model = MODELS[model_name]()
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    handle = surgery.quantize(model, weights=GridSpec(bits=4), target=f"gguf:{kind}", exclude="lm_head")
    record = surgery.export(handle, tmp_path / "m.gguf", format="gguf")
    with torch.no_grad():
        simulated = model(ids).logits.numpy()
    found = llama_cpp_logits(python, record.path, ids, tmp_path)
    cosine = (found * simulated).sum(-1) / (np.linalg.norm(found, axis=-1) * np.linalg.norm(simulated, axis=-1))
    # llama.cpp rounds each activation to 8 bits per block of 32 before its integer dot products
    # (Q8_0 inputs for these types) and keeps its cache in F16: not bit for bit. Measured: every
    # position's cosine above 0.9999, the same next token at 99 % or more of positions; 0.999 and
    # 97 % leave room for another CPU's kernels and still fail a wrong row order or a wrong scale
    assert cosine.min() > 0.999, cosine.min()
    assert (found.argmax(-1) == simulated.argmax(-1)).mean() >= 0.97
