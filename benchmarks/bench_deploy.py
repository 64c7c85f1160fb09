"""Benchmark what ``surgery.export`` deploys against fp32 and against the peers' own int8 flows.

Usage::

    .venv/bin/python benchmarks/bench_deploy.py                      # mlp, resnet18, llama: ~15 min
    .venv/bin/python benchmarks/bench_deploy.py --models mlp --rounds 10
    .venv/bin/python benchmarks/bench_deploy.py --models resnet50 --json /tmp/deploy.json
    .venv/bin/python benchmarks/bench_deploy.py --quality-only       # the accuracy table, ~2 min

Speed and size, one torch thread (and one ONNX Runtime thread), on:

- ``mlp``: three 4096x4096 Linear layers with ReLUs, batch 32;
- ``resnet18`` / ``resnet50``: torchvision, batch 1, 224x224;
- ``llama``: a Llama built from a config (random weights, 4 layers, width 512, vocabulary
  32000), ``decode`` one token at batch 1 and ``prefill`` 128 tokens, no KV cache.

Rows: fp32 eager and compiled (inductor, freezing on for every compiled row); surgery's W8A8
simulation (``quantize(..., target=FORMAT)``, attached); surgery's exports (``onnx`` in ONNX
Runtime, ``torchao`` static and dynamic activations, compiled; ``compressed-tensors`` size
only: its runtime is vLLM); and the peers with their own min-max calibration on the same
batches: torchao ``quantize_(Int8DynamicActivationInt8WeightConfig())`` compiled, pt2e with
``X86InductorQuantizer`` compiled, ONNX Runtime ``quantize_static`` (QDQ, uint8 activations,
int8 per-channel weights). Each row's latency is the median over rounds of its time divided
by fp32 eager's in the same round; the order is shuffled every round. Sizes are the bytes of
the file each flow writes, divided by the fp32 parameters' bytes.

Quality: top-1 accuracy of the shipped digits and MNIST-1D CNNs (ONNX Runtime: ours against
``quantize_static``; inductor: pt2e) and held-out perplexity of the shipped tiny LM
(torchao dynamic int8: ours from GPTQ weights against ``quantize_``), every flow calibrated on
the same training batches. It is a script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

import surgery
from surgery.analysis.metrics import accuracy, perplexity
from surgery.ops.export.deploy_summary import fp32_bytes

EAGER = "fp32 eager"
W8 = surgery.GridSpec(bits=8, symmetric=True, per_channel=True)
A8 = surgery.GridSpec(bits=8)


@dataclass
class Row:
    name: str
    ratio: float = math.nan  # median paired latency ratio to fp32 eager
    ms: float = math.nan
    size: float | None = None  # file bytes / fp32 bytes
    cosine: float | None = None  # against fp32 eager's outputs
    note: str = ""


@dataclass
class Case:
    name: str
    model: nn.Module
    example: tuple[Tensor, ...]
    calibration: list[tuple[Tensor, ...]]
    linear_only: bool  # torchao formats (Linear layers) apply; CNNs go through ONNX and pt2e
    rows: list[Row] = field(default_factory=list)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)
    ).eval()


def llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


class Logits(nn.Module):
    """A causal LM as ids -> logits, so every runtime sees one tensor in, one out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def cases(names: list[str]) -> list[Case]:
    import torchvision

    found = []
    for name in names:
        generator = torch.Generator().manual_seed(1)
        if name == "mlp":
            batches = [(torch.randn(32, 4096, generator=generator),) for _ in range(5)]
            found.append(Case(name, mlp(), batches[0], batches[1:], True))
        elif name in ("resnet18", "resnet50"):
            torch.manual_seed(0)
            model = getattr(torchvision.models, name)().eval()
            batches = [(torch.randn(1, 3, 224, 224, generator=generator),) for _ in range(5)]
            found.append(Case(name, model, batches[0], batches[1:], False))
        elif name == "llama":
            model = Logits(llama())
            for label, length in (("llama decode", 1), ("llama prefill", 128)):
                batches = [(torch.randint(0, 32000, (1, length), generator=generator),) for _ in range(5)]
                found.append(Case(label, model, batches[0], batches[1:], True))
        else:
            raise SystemExit(f"--models: unknown {name!r}; choose from mlp, resnet18, resnet50, llama")
    return found


# --- the flows -----------------------------------------------------------------------------------


def compiled(model: nn.Module) -> Callable:
    return torch.compile(model)


def ours(case: Case, target: str, tmp: Path, rows: dict[str, Callable], sizes: dict[str, float]) -> None:
    """Surgery's simulation for ``target`` and its exports, each as a runnable."""
    model = copy.deepcopy(case.model)
    handle = surgery.quantize(model, weights=W8, activations=A8, target=target, calibration=case.calibration)
    base = fp32_bytes(case.model)
    rows[f"surgery W8A8 simulation ({target})"] = model
    if target == "onnx":
        # weights as uint8 (the default: ONNX Runtime's u8u8 kernels, exact on every CPU) and as
        # int8 (its u8s8 kernels, its own quantizer's layout: exact with VNNI, not without; written
        # unchecked, so its drift shows in the cosine column)
        for weights, row in (("uint8", "surgery -> onnx (ONNX Runtime)"), ("int8", "surgery -> onnx, weights=int8")):
            record = surgery.export(
                handle,
                tmp / f"{case.name}_{weights}.onnx",
                format="onnx",
                inputs=[case.example],
                weights=weights,
                compare=weights == "uint8",
            )
            session = record.load()
            feed = {session.get_inputs()[0].name: case.example[0].numpy()}
            rows[row] = lambda *_, session=session, feed=feed: session.run(None, feed)
            sizes[row] = record.bytes / base
        return
    for mode in ("static", "dynamic"):
        path = tmp / f"{case.name.replace(' ', '_')}_{mode}.pt"
        record = surgery.export(handle, path, format="torchao", activations=mode)
        name = f"surgery -> torchao {mode}, compiled"
        rows[name] = compiled(record.load())
        sizes[name] = record.bytes / base


def ours_compressed_tensors(case: Case, tmp: Path, sizes: dict[str, float]) -> None:
    """Sizes of the compressed-tensors folders (W8A8 int, W4A16 g128) of the decoder layers."""
    for label, weights, activations in (
        ("W8A8", W8, surgery.GridSpec(bits=8, symmetric=True)),
        ("W4A16 g128", surgery.GridSpec(bits=4, symmetric=True, per_channel=True, group_size=128), None),
    ):
        model = copy.deepcopy(case.model.model)
        spec = surgery.QuantizeSpec(weights=weights, activations=activations, select="**.*_proj", where="input")
        calibration = [{"input_ids": b[0]} for b in case.calibration] if activations else None
        with surgery.quantize(model, spec, calibration=calibration) as handle:
            folder = tmp / f"ct_{label.replace(' ', '_')}"
            record = surgery.export(handle, folder, format="compressed-tensors")
        layers = sum(p.numel() * 4 for n, p in case.model.model.named_parameters() if "_proj" in n)
        packed = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        embeddings = sum(p.numel() * 4 for n, p in case.model.model.named_parameters() if "_proj" not in n)
        sizes[f"surgery -> compressed-tensors {label} (decoder layers)"] = (packed - embeddings) / layers
        sizes[f"surgery -> compressed-tensors {label} (whole folder)"] = record.bytes / fp32_bytes(case.model)


def peer_torchao(case: Case, tmp: Path, rows: dict[str, Callable], sizes: dict[str, float]) -> None:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = copy.deepcopy(case.model)
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    path = tmp / f"{case.name.replace(' ', '_')}_torchao_peer.pt"
    torch.save(model.state_dict(), path)
    name = "peer: torchao quantize_ int8 dynamic, compiled"
    rows[name] = compiled(model)
    sizes[name] = path.stat().st_size / fp32_bytes(case.model)


def peer_pt2e(model: nn.Module, example: tuple[Tensor, ...], calibration: list[tuple[Tensor, ...]]) -> nn.Module:
    from torchao.quantization.pt2e import allow_exported_model_train_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    batch = ({0: torch.export.Dim.AUTO},) + (None,) * (len(example) - 1)
    exported = torch.export.export(copy.deepcopy(model), example, dynamic_shapes=batch).module()
    for node in exported.graph.nodes:  # a ReLU module called twice (torchvision's blocks) is two ReLUs
        stack = node.meta.get("nn_module_stack")
        if (
            node.op == "call_function"
            and stack
            and list(stack.values())[-1][1] in (nn.ReLU, "torch.nn.modules.activation.ReLU")
        ):
            key, (name, kind) = list(stack.items())[-1]
            stack[key] = (f"{name}@{node.name}", kind)
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(exported, quantizer)
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    converted = convert_pt2e(prepared)
    allow_exported_model_train_eval(converted)
    return converted


def peer_onnxruntime(
    model: nn.Module, example: tuple[Tensor, ...], calibration: list[tuple[Tensor, ...]], tmp: Path
) -> tuple[Any, int]:
    """ONNX Runtime's own flow: export fp32, ``quantize_static`` with its min-max calibration."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    float_path, int8_path = tmp / "peer_fp32.onnx", tmp / "peer_int8.onnx"
    with torch.no_grad():
        torch.onnx.export(
            model,
            example,
            str(float_path),
            dynamo=True,
            input_names=["x"],
            dynamic_shapes=({0: torch.export.Dim.DYNAMIC},),
            verbose=False,
        )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self.batches, None)
            return None if batch is None else {"x": batch[0].numpy()}

    quantize_static(
        str(float_path),
        str(int8_path),
        Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
    )
    return session(int8_path), int8_path.stat().st_size


def session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# --- timing --------------------------------------------------------------------------------------


def outputs(runnable: Callable, example: tuple[Tensor, ...]) -> Tensor:
    with torch.no_grad():
        found = runnable(*example)
    found = found[0] if isinstance(found, (list, tuple)) else found
    return torch.as_tensor(np.asarray(found)) if not isinstance(found, Tensor) else found


def paired_rounds(rows: dict[str, Callable], example: tuple[Tensor, ...], rounds: int, label: str) -> dict:
    """Median over rounds of each row's time over fp32 eager's in the same round (shuffled order)."""
    rng = np.random.default_rng(0)
    names = list(rows)
    with torch.no_grad():
        for runnable in rows.values():
            for _ in range(3):
                runnable(*example)
        start = time.perf_counter()
        rows[EAGER](*example)
        inner = max(1, int(0.05 / max(time.perf_counter() - start, 1e-6)))
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in tqdm(range(rounds), desc=f"timing {label}", unit="round", file=sys.stderr, leave=False):
            for index in rng.permutation(len(names)):
                runnable = rows[names[index]]
                start = time.perf_counter()
                for _ in range(inner):
                    runnable(*example)
                times[names[index]].append((time.perf_counter() - start) / inner)
    eager = np.asarray(times[EAGER])
    return {name: (float(np.median(np.asarray(t) / eager)), float(np.median(t) * 1e3)) for name, t in times.items()}


def speed(case: Case, rounds: int, peers: bool) -> None:
    rows: dict[str, Callable] = {EAGER: case.model, "fp32 compiled": compiled(case.model)}
    sizes: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        if case.linear_only:
            ours(case, "torchao", tmp, rows, sizes)
            if case.name == "llama decode":
                ours_compressed_tensors(case, tmp, sizes)
            if peers:
                peer_torchao(case, tmp, rows, sizes)
        if not case.name.startswith("llama"):
            ours(case, "onnx", tmp, rows, sizes)
            if peers:
                rows["peer: pt2e X86InductorQuantizer, compiled"] = compiled(
                    peer_pt2e(case.model, case.example, case.calibration)
                )
                runtime, size = peer_onnxruntime(case.model, case.example, case.calibration, tmp)
                feed = {"x": case.example[0].numpy()}
                rows["peer: ONNX Runtime quantize_static"] = lambda *_: runtime.run(None, feed)
                sizes["peer: ONNX Runtime quantize_static"] = size / fp32_bytes(case.model)
        reference = outputs(case.model, case.example).flatten().double()
        cosines = {
            name: float(torch.cosine_similarity(outputs(r, case.example).flatten().double(), reference, dim=0))
            for name, r in rows.items()
        }
        timed = paired_rounds(rows, case.example, rounds, case.name)
    for name, (ratio, ms) in timed.items():
        case.rows.append(Row(name, ratio, ms, sizes.get(name), cosines[name]))
    for name, size in sizes.items():
        if name not in timed:
            case.rows.append(Row(name, size=size, note="size only"))


# --- quality -------------------------------------------------------------------------------------


def quality() -> list[dict[str, Any]]:
    """Accuracy (digits, MNIST-1D) and perplexity (tiny LM) of each flow, same calibration."""
    from surgery.tasks import digits, mnist1d, tinylm

    found = []
    from safetensors.torch import load_model

    evaluate = accuracy
    for label, build, checkpoint, loader in (
        ("digits CNN", digits.DigitsCNN, digits.CHECKPOINT, lambda split: digits.digits_batches(split, 64)),
        ("MNIST-1D CNN", mnist1d.MNIST1DCNN, mnist1d.CHECKPOINT, lambda split: mnist1d.mnist1d_batches(split, 64)),
    ):
        model = build()
        load_model(model, checkpoint)
        model.eval()
        test, train = list(loader("test")), list(loader("train"))
        calibration = [(images,) for images, _ in train[:8]]
        example = calibration[0]
        row = {"model": label, "fp32": 100 * evaluate(model, test)}
        simulated = copy.deepcopy(model)
        handle = surgery.quantize(simulated, weights=W8, activations=A8, target="onnx", calibration=calibration)
        row["surgery simulation"] = 100 * evaluate(simulated, test)
        with tempfile.TemporaryDirectory() as folder:
            record = surgery.export(handle, Path(folder) / "m.onnx", format="onnx", inputs=[example])
            row["surgery -> onnx"] = 100 * evaluate(onnx_module(record.load()), test)
            runtime, _ = peer_onnxruntime(model, example, calibration, Path(folder))
            row["peer: ONNX Runtime quantize_static"] = 100 * evaluate(onnx_module(runtime), test)
        row["peer: pt2e X86InductorQuantizer"] = 100 * evaluate(peer_pt2e(model, example, calibration), test)
        found.append(row)
    model = tinylm.TinyLM()
    load_model(model, tinylm.CHECKPOINT)
    model.eval()
    test = tinylm.token_batches("test", 16)
    calibration = [(ids,) for ids, _ in tinylm.token_batches("train", 16, limit_batches=8)]
    row = {"model": "tiny LM (perplexity)", "fp32": perplexity(model, test)}
    for label, method in (("RTN", "rtn"), ("GPTQ", "gptq")):
        ours_model = copy.deepcopy(model)
        weights = surgery.GridSpec(bits=8, symmetric=True, per_channel=True)
        handle = surgery.quantize(
            ours_model, weights=weights, method=method, exclude=["head"], target="torchao", calibration=calibration
        )
        with tempfile.TemporaryDirectory() as folder:
            record = surgery.export(handle, Path(folder) / "m.pt", format="torchao", activations="dynamic")
            row[f"surgery {label} -> torchao dynamic"] = perplexity(record.load(), test)
    peer = copy.deepcopy(model)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(peer.blocks, Int8DynamicActivationInt8WeightConfig())
    row["peer: torchao quantize_ int8 dynamic"] = perplexity(peer, test)
    found.append(row)
    return found


class onnx_module(nn.Module):  # noqa: N801 - used like a function
    """An ONNX Runtime session as a module, so the tasks' metrics can call it."""

    def __init__(self, runtime: Any) -> None:
        super().__init__()
        self.runtime = runtime
        self.input = runtime.get_inputs()[0].name

    def forward(self, x: Tensor) -> Tensor:
        return torch.from_numpy(self.runtime.run(None, {self.input: x.numpy()})[0])


# --- output --------------------------------------------------------------------------------------


def print_speed(case: Case) -> None:
    print(f"\n{case.name}: ratio to fp32 eager (1 thread, paired rounds); size: file / fp32 bytes")
    print(f"  {'':52} {'latency':>8} {'ms':>8} {'size':>6} {'cosine':>9}")
    for row in case.rows:
        size = f"{row.size:.3f}" if row.size is not None else "-"
        cosine = f"{row.cosine:.6f}" if row.cosine is not None else "-"
        ratio = f"{row.ratio:.3f}x" if not math.isnan(row.ratio) else "-"
        ms = f"{row.ms:.2f}" if not math.isnan(row.ms) else "-"
        print(f"  {row.name:52} {ratio:>8} {ms:>8} {size:>6} {cosine:>9}")


def print_quality(table: list[dict[str, Any]]) -> None:
    print("\nquality (accuracy %, perplexity for the tiny LM), every flow on the same calibration batches")
    for row in table:
        print(f"  {row['model']}")
        for name, value in row.items():
            if name != "model":
                print(f"    {name:44} {value:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet18,llama", help="mlp, resnet18, resnet50, llama")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-peers", action="store_true", help="leave out the peers' flows")
    parser.add_argument("--quality-only", action="store_true")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch._inductor.config.freezing = True  # what pt2e's int8 lowering needs; applied to every compiled row
    found: dict[str, Any] = {"torch": torch.__version__, "speed": {}, "quality": []}
    if not args.quality_only:
        for case in cases(args.models.split(",")):
            speed(case, args.rounds, not args.no_peers)
            print_speed(case)
            found["speed"][case.name] = [row.__dict__ for row in case.rows]
    if not args.no_quality:
        found["quality"] = quality()
        print_quality(found["quality"])
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
