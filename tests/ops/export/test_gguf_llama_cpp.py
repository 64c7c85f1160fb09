"""llama.cpp itself runs surgery's GGUF files: the shipped tiny Llama and Qwen3 calibrated onto
the legacy types, their logits from llama-cpp-python (in the benchmark's own environment,
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
from surgery.ops.export.formats.gguf.file import write_gguf
from surgery.ops.numerics.deployment import ExportParts
from surgery.tasks.tinyllama import load_llama
from surgery.tasks.tinymoe import load_moe
from surgery.tasks.tinyqwen3 import load_qwen3

pytestmark = pytest.mark.peers  # llama.cpp, built into benchmarks/.venv-llama_cpp by `make test-peers`
REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "llama_cpp_runner.py"
MODELS = {"tinyllama": load_llama, "tinyqwen3": load_qwen3, "tinymoe": load_moe}  # tinymoe: Qwen3-MoE, 8 experts


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


def cosines(found: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """The cosine similarity of every position's logits."""
    return (found * expected).sum(-1) / (np.linalg.norm(found, axis=-1) * np.linalg.norm(expected, axis=-1))


def llama_cpp_or_skip() -> Path:
    python = peer_python("llama_cpp")
    if python is None:
        pytest.skip(
            "llama-cpp-python is not built: run benchmarks/bench_gguf.py once (it makes benchmarks/.venv-llama_cpp)"
        )
    return python


IDS = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model_name", list(MODELS))
def test_llama_cpp_reads_the_float_file_as_the_model_computes(tmp_path, model_name):
    # F32 tensors: llama.cpp multiplies in float (no activation rounding), so only its summation
    # order differs: measured cosine above 0.99999 at every position, a wrong name, row order or
    # hyperparameter would not come near
    python = llama_cpp_or_skip()
    model = MODELS[model_name]()
    write_gguf(ExportParts(model), tmp_path / "m.gguf", {})
    with torch.no_grad():
        expected = model(IDS).logits.numpy()
    assert cosines(llama_cpp_logits(python, tmp_path / "m.gguf", IDS, tmp_path), expected).min() > 0.9999


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_llama_cpp_computes_the_simulation_s_logits_within_its_activation_rounding(tmp_path, model_name, kind):
    python = llama_cpp_or_skip()
    model = MODELS[model_name]()
    with surgery.quantize(model, weights=GridSpec(bits=4), target=f"gguf:{kind}", exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf")
        with torch.no_grad():
            simulated = model(IDS).logits.numpy()
    found = llama_cpp_logits(python, record.path, IDS, tmp_path)
    cosine = cosines(found, simulated)
    # llama.cpp rounds each activation to 8 bits per block of 32 before its integer dot products
    # (Q8_0 inputs for these types) and caches keys and values in F16: not bit for bit. Measured
    # on both models and the three types: mean cosine 0.99972 or more, every position 0.990 or
    # more, the same next token at 95 % or more of positions; the bounds leave room for another
    # CPU's kernels and still fail a wrong scale sign, block order or row order
    assert cosine.mean() > 0.999 and cosine.min() > 0.98, (cosine.mean(), cosine.min())
    assert (found.argmax(-1) == simulated.argmax(-1)).mean() >= 0.93


@pytest.mark.parametrize("kind", ["Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_llama_cpp_computes_the_simulation_s_logits_on_the_k_quants(tmp_path, kind):
    # the shipped models' rows (128 inputs) are not whole super-blocks of 256: a seeded random
    # Llama of width 256 instead. Measured: mean cosine 0.99992, every position 0.9998 or more
    # (llama.cpp rounds activations to Q8_K blocks of 256); a wrong sub-scale bit or order falls far
    import transformers

    python = llama_cpp_or_skip()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config.vocab_size = 256
    model = transformers.LlamaForCausalLM(config).eval()
    with surgery.quantize(model, weights=GridSpec(bits=4), target=f"gguf:{kind}", exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf")
        with torch.no_grad():
            simulated = model(IDS).logits.numpy()
    cosine = cosines(llama_cpp_logits(python, record.path, IDS, tmp_path), simulated)
    assert cosine.mean() > 0.9995 and cosine.min() > 0.999, (cosine.mean(), cosine.min())


def llama_quantize_or_skip() -> Path:
    found = REPO / "benchmarks" / ".venv-llama_cpp" / "tools" / "build" / "bin" / "llama-quantize"
    if not found.exists():
        pytest.skip("llama.cpp's llama-quantize is not built: run benchmarks/bench_gguf.py once (peer_venvs.py)")
    return found


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M"])
def test_a_gguf_mix_gives_every_tensor_the_type_llama_quantize_gives_it(tmp_path, mix):
    import gguf
    import transformers

    tool = llama_quantize_or_skip()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2
    )
    model = transformers.LlamaForCausalLM(config).eval()
    write_gguf(ExportParts(model), tmp_path / "float.gguf", {})
    flags = ["--output-tensor-type", "f32", "--token-embedding-type", "f32"]
    done = subprocess.run(
        [str(tool), *flags, str(tmp_path / "float.gguf"), str(tmp_path / "theirs.gguf"), mix, "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = {
        t.name: gguf.GGMLQuantizationType(t.tensor_type).name
        for t in gguf.GGUFReader(tmp_path / "theirs.gguf").tensors
        if t.name.startswith("blk.") and len(t.shape) > 1  # every block's Linear weights
    }
    with surgery.gguf_mix(model, mix).apply(model) as handle:
        surgery.export(handle, tmp_path / "ours.gguf", format="gguf")
    ours = {
        t.name: gguf.GGMLQuantizationType(t.tensor_type).name
        for t in gguf.GGUFReader(tmp_path / "ours.gguf").tensors
        if t.name in theirs
    }
    assert ours == theirs and len(theirs) == 7 * 12  # every Linear of the 12 blocks
    assert "Q6_K" in theirs.values()  # some layers' value and down projections get more bits


@pytest.mark.parametrize("split", ["gpt-2", "llama-bpe", "qwen2", "sentencepiece", "sentencepiece-legacy"])
def test_llama_cpp_tokenizes_text_as_the_hugging_face_tokenizer_the_file_carries(tmp_path, split):
    import transformers
    from support import byte_bpe_tokenizer, sentencepiece_tokenizer

    python = llama_cpp_or_skip()
    # 600 tokens: enough merges that each split gives other ids than the others; SentencePiece's
    # byte fallback and merges by score (Llama 2, Mistral), trained offline and converted by transformers
    if split.startswith("sentencepiece"):
        tokenizer = sentencepiece_tokenizer(legacy=split.endswith("legacy"))
    else:
        tokenizer = byte_bpe_tokenizer(600, split)
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, vocab_size=len(tokenizer))).eval()
    write_gguf(ExportParts(model), tmp_path / "m.gguf", {"tokenizer": tokenizer})
    texts = [
        "Hello world, it's 3.14 here.",
        "  two  spaces\tand tabs\n",
        "caf\u00e9 na\u00efve\u2014 emoji \U0001f600 end",
        "The quick brown fox jumps over the lazy dog. " * 3,
        "IT'S 1234567 o'clock, WE'LL see\r\n\n  end",  # the splits differ on digits, case and line ends
        'In 2024: 12345 (word) "quote",comma THEY\'VE\r\n\n  ',
    ]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    done = subprocess.run(
        [
            str(python),
            str(SCRIPT),
            "tokenize",
            str(tmp_path / "m.gguf"),
            str(tmp_path / "texts.json"),
            str(tmp_path / "o.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads((tmp_path / "o.json").read_text())
    # transformers 5's Metaspace puts no ▁ before a text that starts with a space; llama.cpp (and
    # SentencePiece) does, as the legacy normalizer does: the export warns of it
    shifted = split == "sentencepiece"
    expected = [" " + text if shifted and text.startswith(" ") else text for text in texts]
    assert found == [tokenizer.encode(text, add_special_tokens=False) for text in expected]


@pytest.mark.slow  # ~30 s: the recipe's run, its file then run by llama.cpp on the held-out windows
def test_report_deploy_measures_llama_cpp_against_the_simulation_and_its_perplexity(tmp_path, monkeypatch):
    from support import run_recipe

    monkeypatch.setenv("SURGERY_LLAMA_CPP_PYTHON", str(llama_cpp_or_skip()))
    report = run_recipe(tmp_path, "recipe=quantize_llama_gguf", "quantize.method=rtn", "data.batches=2")
    deploy, row = report["deploy"], next(check for check in report["checks"] if check["name"] == "deploy")
    found = deploy["llama_cpp"]
    assert row["passed"] and found["holds"] and found["cosine_mean"] > 0.9999, found
    # the same held-out windows: llama.cpp's activation rounding moves perplexity by well under 1 %
    assert abs(found["perplexity"] / deploy["perplexity"] - 1) < 0.01, (found["perplexity"], deploy["perplexity"])


def test_llama_cpp_against_another_model_s_logits_misses_the_bound(tmp_path, monkeypatch):
    from surgery.ops.export.formats.gguf.llama_cpp_runtime import llama_cpp_summary

    monkeypatch.setenv("SURGERY_LLAMA_CPP_PYTHON", str(llama_cpp_or_skip()))
    write_gguf(ExportParts(load_llama()), tmp_path / "m.gguf", {})
    found = llama_cpp_summary(tmp_path / "m.gguf", load_qwen3(), [IDS], None)  # the other shipped model
    assert found["holds"] is False and found["cosine_mean"] < 0.9, found
