"""Small helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


def examples(share: float) -> int:
    """A Hypothesis test's number of examples: ``share`` of the loaded profile's (tests/conftest.py:
    100 in `make test`, 1000 with SURGERY_HYPOTHESIS=thorough)."""
    from hypothesis import settings

    return max(1, round(settings.default.max_examples * share))


class Passthrough(nn.Module):
    """A wrapper that changes nothing: the identity wrap."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])


class Tied(nn.Module):
    """Two Linear layers sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@functools.cache
def run_recipe(folder: Path, *args: str) -> dict:
    """``python -m surgery ARGS`` run into ``folder`` (in this process: tests/cli_runner.py); its
    ``report.json`` (the run must succeed: its stderr's tail is the failure message otherwise)."""
    from cli_runner import run_cli

    result = run_cli(*args, f"hydra.run.dir={folder}")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "report.json").read_text())


def peer_python(package: str) -> Path | None:
    """The interpreter of a peer's own environment made by the benchmarks
    (``benchmarks/.venv-<package>``), or None when it is absent or cannot import ``package``."""
    python = Path(__file__).resolve().parents[1] / "benchmarks" / f".venv-{package}" / "bin" / "python"
    if not python.exists():
        return None
    found = subprocess.run([str(python), "-c", f"import {package}"], capture_output=True, check=False)
    return python if found.returncode == 0 else None


def tiny_gpt2() -> nn.Module:
    """A two-layer GPT-2 built from a config (never downloaded), seeded, in eval mode."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def edit_in_place(model: nn.Module, amount: float = 0.1) -> None:
    """Move every parameter by ``amount`` in place, as a hand-written update would: versions
    bump, but no optimizer step hook sees it, so only the forward-pre hooks re-apply surgery."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(amount)


def image_folder(root: Path, labels: tuple[str, ...], per_label: int, size: tuple[int, int], seed: int) -> Path:
    """A folder of random PNGs in class sub-folders (what torchvision's ImageFolder reads)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label in labels:
        (root / label).mkdir(parents=True)
        for index in range(per_label):
            Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(root / label / f"{index}.png")
    return root


def local_tokenizer(folder: Path, text: str, vocab: int) -> Path:
    """A small BPE tokenizer trained here and saved as a local folder (AutoTokenizer reads it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(str(folder))
    return folder


class Poisoned(nn.Module):
    """The wrapped model's output with some entries replaced by ``value`` (NaN or Inf)."""

    def __init__(self, inner: nn.Module, value: float, count: int) -> None:
        super().__init__()
        self.inner, self.value, self.count = inner, value, count

    def forward(self, x):
        y = self.inner(x).clone()
        y.view(-1)[: self.count] = self.value
        return y


class NormAct(nn.BatchNorm2d):
    """A BatchNorm subclass that does more than normalise (timm's BatchNormAct2d)."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


def trained_stats(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def gpt2(layers: int) -> nn.Module:
    """A two-head, 32-wide GPT-2 language model of ``layers`` blocks (seeded)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def token_batches(count: int = 3) -> list[dict]:
    """``count`` batches of 4 x 16 token ids (vocabulary 64) with their attention masks."""
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, 64, (4, 16), generator=generator),
            "attention_mask": torch.ones(4, 16, dtype=torch.long),
        }
        for _ in range(count)
    ]


def tiny_llama(
    layers: int = 2,
    vocab: int = 128,
    dtype: torch.dtype = torch.float32,
    *,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = False,
) -> nn.Module:
    """A random Llama (seeded), ``hidden`` wide with ``heads`` heads and ``kv_heads`` key/value
    heads and an MLP twice as wide, in ``dtype``; ``tied``: the head shares the embeddings."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        architectures=["LlamaForCausalLM"],
        dtype=dtype,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v3", "gpt_oss")


def tiny_moe(family: str, layers: int = 1, *, hidden: int = 32, experts: int = 4, top_k: int = 2) -> nn.Module:
    """A random mixture-of-experts decoder of ``family`` (one of :data:`MOE_FAMILIES`), seeded, in
    fp32, with every expert and router weight (and bias) non-trivial."""
    import transformers

    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        head_dim=hidden // 4,
    )
    width = hidden // 2 * 3
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(
            **common, intermediate_size=width, num_local_experts=experts, num_experts_per_tok=top_k
        ),
        "phimoe": lambda: transformers.PhimoeConfig(
            **common, intermediate_size=width, num_local_experts=experts, num_experts_per_tok=top_k
        ),
        "olmoe": lambda: transformers.OlmoeConfig(
            **common, intermediate_size=width, num_experts=experts, num_experts_per_tok=top_k
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=2 * width,
            moe_intermediate_size=width,
            num_experts=experts,
            num_experts_per_tok=top_k,
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=2 * width,
            moe_intermediate_size=width,
            shared_expert_intermediate_size=width,
            num_experts=experts,
            num_experts_per_tok=top_k,
        ),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{**{k: v for k, v in common.items() if k != "head_dim"}, "num_key_value_heads": 4},
            intermediate_size=2 * width,
            moe_intermediate_size=width,
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        "gpt_oss": lambda: transformers.GptOssConfig(
            **common,
            intermediate_size=width,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            layer_types=["full_attention"] * layers,
        ),
    }
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs[family]()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "experts" in name or "router" in name or name.endswith("gate.weight"):
                param.normal_(0, 0.5)
    return model


def routed(model: nn.Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``model``'s logits on ``batch`` and the experts each mixture-of-experts layer's router chose
    for each token (sorted), read from the experts module's arguments."""
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: chosen.append(args[1].sort(-1).values))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            logits = model(**batch).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, chosen


def plant_code(folder: Path, config_file: str, auto_map: dict, **fields: str) -> Path:
    """Add to the Hugging Face ``folder`` an ``auto_map`` in ``config_file`` naming classes of
    ``custom.py``, a file that writes the returned marker file when it is imported (``fields``:
    a class transformers does not know, so that it needs the folder's code)."""
    import json

    marker = folder.parent / f"{folder.name}-code-ran"
    (folder / "custom.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
        "from transformers import LlamaConfig, PreTrainedTokenizerFast\n"
        "class Config(LlamaConfig):\n    pass\n"
        "class Tokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    path = folder / config_file
    found = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**found, **fields, "auto_map": auto_map}))
    return marker


def under_terminal(work: Callable[[], object], cwd: Path, home: Path, answer: str = "y\n", timeout: float = 300) -> str:
    """Run ``work`` in a forked copy of this process whose standard streams are a pseudo-terminal,
    from ``cwd``, with ``answer`` typed ahead (for any prompt it asks) and ``home`` as transformers'
    cache; everything it printed (an exception's traceback included). A copy, not a new
    interpreter: nothing to import again, and its own end (``os._exit``) leaves this process as it was."""
    import os
    import pty
    import select
    import time
    import traceback

    pid, main = pty.fork()
    if pid == 0:  # the copy: its stdio is the terminal; never return into pytest
        code = 0
        try:
            os.environ["HF_HOME"] = str(home)  # where transformers would copy a folder's code
            os.chdir(cwd)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the terminal, for the copy's life
            sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            work()
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else 1
        except BaseException:  # noqa: BLE001 - printed, as an interpreter would
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        os._exit(code)
    os.write(main, answer.encode())
    output, deadline, closed, reaped = b"", time.monotonic() + timeout, False, False
    while time.monotonic() < deadline and not (closed or reaped):
        if select.select([main], [], [], 0.2)[0]:
            try:
                data = os.read(main, 65536)
            except OSError:  # the copy closed the terminal
                data = b""
            output += data
            closed = not data
        else:
            reaped = os.waitpid(pid, os.WNOHANG)[0] != 0
    if not reaped and os.waitpid(pid, os.WNOHANG)[0] == 0:  # still running: past the deadline
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    os.close(main)
    return output.decode(errors="replace").replace("\r\n", "\n")


@functools.cache
def sentencepiece_tokenizer(size: int = 600, legacy: bool = False) -> Any:
    """A SentencePiece BPE tokenizer (byte fallback, as Llama 2's and Mistral's) trained offline on
    the tiny-LM corpus's training bytes, converted by transformers as it converts theirs (from the
    ``tokenizer.model`` in a folder), as a fast tokenizer that puts ``<s>`` first. Its spaces go
    through a Metaspace pre-tokenizer, as transformers 5 writes them; ``legacy``: through the
    normalizer transformers 4 wrote (Llama 2's, Mistral 7B v0.1's and TinyLlama's tokenizer.json)."""
    import sentencepiece
    from transformers import AutoTokenizer

    from surgery.tasks.tinylm import tokens

    with tempfile.TemporaryDirectory(prefix="surgery-spm-") as name:
        folder = Path(name)
        text = bytes(tokens("train")[:100_000].tolist()).decode("utf-8", "replace") + SPLIT_TEXT * 20
        (folder / "corpus.txt").write_text("\n".join(line for line in text.split("\n") if line.strip()))
        sentencepiece.SentencePieceTrainer.train(
            input=str(folder / "corpus.txt"),
            model_prefix=str(folder / "tokenizer"),
            vocab_size=size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            minloglevel=2,
        )
        config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True}))
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not legacy:
        return tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    prepend = {"type": "Prepend", "prepend": "\u2581"}
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [prepend, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}],
    }
    spec["pre_tokenizer"] = None
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **config)


def devices() -> list:
    """The devices present, as pytest parameters: the CPU, and CUDA (marked ``cuda``, so
    ``scripts/gpu_check.sh`` selects it with ``-m cuda``) where a GPU is."""
    import pytest

    found = [pytest.param("cpu", id="cpu")]
    if torch.cuda.is_available():
        found.append(pytest.param("cuda", id="cuda", marks=pytest.mark.cuda))
    return found


SPLIT_TEXT = "In 1999, 2024 and 365 days: 12345 items. IT'S WE'LL THEY'VE (word) \"quote\",comma\r\n\n  "


@functools.cache
def byte_bpe_tokenizer(size: int = 320, split: str = "gpt-2") -> Any:
    """A byte-level BPE tokenizer trained offline on the tiny-LM corpus's training bytes (``size``
    tokens), as a transformers fast tokenizer, split as llama.cpp's ``split`` pre-tokenizer
    splits: ``gpt-2`` (GPT-2's, ``<|endoftext|>`` its eos); ``llama-bpe`` (Llama 3's regex, words
    in the vocabulary skip the merges, ``<|begin_of_text|>`` put first as its bos); ``qwen2``
    (Qwen2's regex after NFC, ``<|endoftext|>`` its eos)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from surgery.ops.export.formats.gguf.tokenizer import SPLITS
    from surgery.tasks.tinylm import tokens

    text = bytes(tokens("train")[:100_000].tolist()).decode("utf-8", "replace")
    text += SPLIT_TEXT * 100  # merges where the splits cut digits, cased contractions and punctuation apart
    backend = Tokenizer(models.BPE(ignore_merges=split == "llama-bpe"))
    if split == "gpt-2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        pattern = next(regex for regex, pre in SPLITS.items() if pre.name == split)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if split == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"] if split == "llama-bpe" else ["<|endoftext|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=special, initial_alphabet=alphabet)
    backend.train_from_iterator([text[i : i + 1000] for i in range(0, len(text), 1000)], trainer)
    if split != "llama-bpe":
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    bos = (special[0], backend.token_to_id(special[0]))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A $B", special_tokens=[bos]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=special[0], eos_token=special[1])


def exit_code_of_a_child(work: Callable[[], object]) -> int:
    """Run ``work`` in a forked copy of this process and return the copy's exit code: what a
    process killed outright leaves behind (``os._exit``: no cleanup, no ``finally``, no atexit),
    without a new interpreter's start-up. ``work`` may end the copy itself with ``os._exit``."""
    import os

    pid = os.fork()
    if pid == 0:  # the copy: never return into pytest
        code = 0
        try:
            work()
        except BaseException:  # noqa: BLE001 - the copy's only answer is its exit code
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def in_a_child(work: Callable[[], object]) -> None:
    """Run ``work`` in a forked copy of this process (what it changes dies with the copy); an
    exception there is raised here as an AssertionError carrying the copy's traceback."""
    import tempfile
    import traceback

    with tempfile.TemporaryFile("w+") as why:

        def reporting() -> None:
            try:
                work()
            except BaseException:
                why.write(traceback.format_exc())
                why.flush()
                raise

        code = exit_code_of_a_child(reporting)
        why.seek(0)
        assert code == 0, why.read()[-5000:] or f"the copy ended with exit code {code}"


def dead_pid() -> int:
    """The process id of a process of this host that has ended."""
    import os

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


class MemoryProbe:
    """One process of tests/memory_probe.py, asked for each peak in turn: a memory peak is a
    process's own, and one process serves every measurement instead of one start-up each."""

    def __init__(self) -> None:
        import os

        script = Path(__file__).with_name("memory_probe.py")
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors go back: the peak is what was held
        self.process = subprocess.Popen(
            [sys.executable, str(script), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def peak(self, *args: str) -> float:
        """What ``python tests/memory_probe.py ARGS`` prints: one probe's peak."""
        self.process.stdin.write(json.dumps(list(args)) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the memory probe ended (exit {self.process.wait()})"
        reply = json.loads(line)
        assert "error" not in reply, reply["error"]
        return reply["value"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.process.stdout.close()
