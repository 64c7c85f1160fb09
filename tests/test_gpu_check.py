"""``scripts/gpu_check.sh --dry-run``: the GPU check runs end to end here (toy sizes, the CPU):
its CUDA tests are collected and skipped, its table has every row, figures or a reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~20 s: the CUDA test subset collected, three calibrations, the kernels and a loaded export at toy sizes
def test_the_gpu_check_dry_run_writes_every_row(tmp_path):
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", f"--out={tmp_path}"],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHON": sys.executable},
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    found = json.loads((tmp_path / "gpu_check.json").read_text())
    assert found["dry_run"] is True and "torch" in found["device"]
    calibration = {row["name"]: row for row in found["calibration"]}
    assert all(calibration[f"surgery {m} W4 g32"]["seconds_per_block"] > 0 for m in ("GPTQ", "AWQ", "AutoRound"))
    assert "skipped" in calibration["llm-compressor GPTQModifier W4 g128"]
    kernels = {(row["kernel"], row["shape"]): row for row in found["kernels"]}
    assert len(kernels) == 12  # six kernels at the decode and prefill shapes
    for (name, _), row in kernels.items():
        if name.startswith(("FP8", "int4 weight-only")):  # on the CPU: its scaled matmul, its int4 kernel
            assert row["cosine"] > 0.9999 and row["latency_vs_bf16"] > 0, row
        else:  # 2:4, int8 and torchao's int4 are measured on CUDA, said in the row
            assert "CUDA" in row["skipped"], row
    loaded = {row["shape"]: row for row in found["loaded"]}  # the W4A16 export, loaded by transformers
    assert set(loaded) == {"decode", "prefill"}
    for row in loaded.values():
        assert row["cosine"] > 0.9999 and row["latency_vs_bf16"] > 0 and row["linear_loads_as"], row
    assert (tmp_path / "gpu_check.md").read_text().startswith("# gpu_check on ")
    assert "2 skipped" in (tmp_path / "tests.log").read_text()  # the CUDA tests, collected and skipped


def test_an_unknown_argument_is_refused_in_one_line():
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--fast"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr == "gpu_check: unknown argument '--fast' (allowed: --dry-run, --out=DIR)\n"
