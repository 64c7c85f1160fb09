"""``recipe=quantize_llama_gguf`` end to end: the shipped tiny Llama on llama.cpp's Q4_0 grid,
written as Q4_0 tensors, loaded back through transformers' GGUF loader with the run's logits."""

from __future__ import annotations

import pytest
from support import run_recipe  # tests/support.py


@pytest.mark.slow  # ~25 s: a run with its round-trip checks and the deploy check
def test_quantize_llama_gguf_writes_q4_0_tensors_that_load_with_the_run_s_logits(tmp_path):
    gguf = pytest.importorskip("gguf")
    report = run_recipe(tmp_path, "recipe=quantize_llama_gguf", "quantize.method=rtn", "data.batches=1")
    checks = {check["name"]: check for check in report["checks"]}
    deploy = report["deploy"]
    assert checks["deploy"]["passed"] and (deploy["expected"], deploy["max_abs"]) == ("exact", 0.0)
    kinds = {
        t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(tmp_path / "export.gguf").tensors
    }
    assert kinds["blk.0.attn_q.weight"] == kinds["blk.3.ffn_down.weight"] == "Q4_0"
    assert kinds["output.weight"] == kinds["token_embd.weight"] == kinds["output_norm.weight"] == "F32"
    assert sum(kind == "Q4_0" for kind in kinds.values()) == 28  # every Linear of the 4 blocks


@pytest.mark.slow  # ~25 s: the recipe's run again, its weights written as another type that holds their grid
def test_export_type_writes_every_quantized_weight_as_that_type(tmp_path):
    gguf = pytest.importorskip("gguf")
    args = ["recipe=quantize_llama_gguf", "quantize.method=rtn", "data.batches=1", "export.type=Q8_0"]
    assert run_recipe(tmp_path, *args)["deploy"]["max_abs"] == 0.0
    kinds = [gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(tmp_path / "export.gguf").tensors]
    assert kinds.count("Q8_0") == 28 and "Q4_0" not in kinds  # Q8_0 holds the Q4_0 grid exactly


def test_export_type_is_the_shorthand_of_its_option_and_a_disagreement_is_refused():
    from surgery.cli.config import ExportConfig
    from surgery.core.errors import ConfigError

    assert ExportConfig(format="gguf", type="Q6_K").options == {"type": "Q6_K"}
    with pytest.raises(ConfigError, match=r"^export\.type='Q6_K': and export\.options\.type='Q4_0' disagree; set one$"):
        ExportConfig(format="gguf", type="Q6_K", options={"type": "Q4_0"})
