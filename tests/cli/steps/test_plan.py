"""The ``plan`` step end to end: ``recipe=plan_llama`` on the shipped tiny Llama, its plan
within the budget in ``plan.json`` and ``report.json``, exported to compressed-tensors."""

from __future__ import annotations

import json

import pytest
from cli_runner import run_cli  # tests/cli_runner.py
from support import run_recipe  # tests/support.py


@pytest.mark.slow  # ~60 s of CPU: the plan's gradient scores, the export and its deploy check
def test_plan_llama_writes_its_plan_within_the_budget_and_a_compressed_tensors_folder_that_loads(tmp_path):
    pytest.importorskip("compressed_tensors")
    args = ["recipe=plan_llama", "budget=4.5bpw", "data.batches=1", "plan.calibration_batches=1"]
    report = run_recipe(tmp_path, *args, "export.format=compressed-tensors")
    plan, saved = report["plan"], json.loads((tmp_path / "plan.json").read_text())
    assert plan["bits_per_weight"] <= 4.5 and plan["bytes"] <= plan["budget_bytes"] == saved["budget"]
    assert plan["counts"] == saved["counts"] and plan["bytes"] == saved["total_bytes"]
    checks = {check["name"]: check["passed"] for check in report["checks"]}
    assert checks["deploy"] is True and report["deploy"]["format"] == "compressed-tensors"  # loaded by transformers
    config = json.loads((tmp_path / "export" / "config.json").read_text())["quantization_config"]
    quantized = {k for k, n in plan["counts"].items() if k != "dense"}
    assert len(config["config_groups"]) == len(quantized)


@pytest.mark.slow  # ~15 s: the plan's scores and the run's round-trip checks
def test_plan_llama_with_cache_choices_plans_the_cache_and_its_rounding_survives_bake_and_reload(tmp_path):
    choices = "plan.choices=[dense,int8,w4g128,w3g128,kv16,kv_int8,kv_int4]"
    args = ["recipe=plan_llama", "budget=1.5MB", "plan.kv_tokens=4096", choices, "data.batches=1"]
    result = run_cli(*args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    plan, saved = report["plan"], json.loads((tmp_path / "plan.json").read_text())
    caches = [row for row in saved["layers"] if row["target"] == "kv_cache"]
    assert len(caches) == 4 and plan["kv_tokens"] == saved["kv_tokens"] == 4096  # the tiny Llama's 4 attentions
    assert 0 < plan["kv_cache_bytes"] == sum(row["bytes"] for row in caches) <= plan["bytes"] <= 1_500_000
    assert {row["choice"] for row in caches} <= {"kv_int8", "kv_int4"}  # kv16's 4 MiB cannot fit 1.5 MB
    checks = {check["name"]: check["passed"] for check in report["checks"]}
    assert checks["bake"] is True and checks["save_load"] is True  # the cache's rounding is re-attached
    assert "KV cache at 4,096 tokens" in result.stdout


@pytest.mark.slow  # ~30 s: a run on a random Llama of width 256, GPTQ on each layer's type, the export and its checks
def test_plan_mix_writes_llama_cpp_s_q4_k_m_types_as_one_exact_gguf_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    shape = "{hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, num_attention_heads: 4, vocab_size: 256}"
    args = ["recipe=plan_llama", "model.path=null", "model.name=llama", f"+model.config={shape}", "plan.mix=Q4_K_M"]
    args += ["plan.method=gptq", "export.format=gguf", "data.batches=1", "plan.calibration_batches=1"]
    report = run_recipe(tmp_path, *args)
    # 2 layers: use_more_bits(i, 2) holds for layer 1 alone (7 * 2 // 8 = 1), so its v and down projections
    assert report["plan"]["counts"] == {"gguf:Q4_K": 12, "gguf:Q6_K": 2} and report["plan"]["estimate"] == "rule"
    assert report["deploy"]["max_abs"] == 0.0
    kinds = {
        t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(tmp_path / "export.gguf").tensors
    }
    assert kinds["blk.1.attn_v.weight"] == kinds["blk.1.ffn_down.weight"] == "Q6_K"
    assert kinds["blk.0.attn_v.weight"] == kinds["blk.1.attn_q.weight"] == "Q4_K"
