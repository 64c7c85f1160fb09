"""The methods the peers ship, on a shipped trained model (the tiny Llama, or the tiny dense Qwen3:
``--model``), beside the peers' implementation of each: held-out perplexity over every window of
the tiny-LM corpus's held-out 10 %.

Run by ``bench_calibrated.py --llama`` (about 5 minutes). Each of our rows is applied to the
shipped model, measured and restored (bit-exact, checked); each of llm-compressor's runs
``benchmarks/llmcompressor_quality.py`` in its own virtual environment (llm-compressor pins torch
<= 2.14.0), and each of auto-round's ``benchmarks/autoround_quality.py`` in its own, both made on
first use (``peer_venvs.py``), on the same model, calibration windows and held-out windows. A
script, not a test.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peer_venvs import peer_python  # beside this script

import surgery
from surgery import GridSpec
from surgery.analysis.metrics import perplexity
from surgery.tasks import tinyllama, tinyqwen3
from surgery.tasks.tinylm import token_batches
from surgery.testing import snapshot, snapshot_differences

HERE = Path(__file__).resolve().parent
HEAD = "lm_head"
MODELS: dict[str, tuple[Path, Callable[[], torch.nn.Module]]] = {
    "tinyllama": (tinyllama.FOLDER, tinyllama.load_llama),
    "tinyqwen3": (tinyqwen3.FOLDER, tinyqwen3.load_qwen3),
}

# (row, our recipe, llm-compressor's method name for llmcompressor_quality.py, note)
Recipe = Callable[[torch.nn.Module, list], list]
G64 = ",group_size=64"


def _quantize(bits: int, method: str = "rtn", symmetric: bool = True, group: int = 128, **options: object) -> Recipe:
    spec = GridSpec(bits=bits, group_size=group, symmetric=symmetric, **options)
    return lambda m, cal: [
        surgery.quantize(m, weights=spec, method=method, calibration=cal, exclude=HEAD, progress=False)
    ]


def _float(format: str, method: str = "rtn") -> Recipe:
    """Weights alone on a floating-point grid (``mxfp4``: E8M0 scales per 32; ``nvfp4``: E4M3 per 16)."""
    spec = GridSpec(format=format)
    return lambda m, cal: [
        surgery.quantize(m, weights=spec, method=method, calibration=cal, exclude=HEAD, progress=False)
    ]


def _autoround(bits: int, symmetric: bool, group: int = 128, observer: str = "minmax", awq: bool = False) -> Recipe:
    """AutoRound with every calibration window a sample of its own, as auto-round samples them
    (a step tunes on 8 of the 32 windows, drawn by its seeded sampler); ``awq``: AWQ's scales
    (and clipping search) on the same grid first."""
    spec = GridSpec(bits=bits, group_size=group, symmetric=symmetric, observer=observer)

    def run(m: torch.nn.Module, cal: list) -> list:
        grid = GridSpec(bits=bits, group_size=group, observer=observer)  # AWQ's search on the grid tuned next
        first = [surgery.awq(m, weights=grid, calibration=cal, progress=False)] if awq else []
        samples = [w[None] for b in cal for w in b]
        return [
            *first,
            surgery.quantize(
                m,
                weights=spec,
                method={"name": "autoround", "iterations": 200},
                calibration=samples,
                exclude=HEAD,
                progress=False,
            ),
        ]

    return run


def _float_autoround(format: str) -> Recipe:
    """AutoRound onto a floating-point grid (``mxfp4``, ``nvfp4``), every window a sample."""
    spec = GridSpec(format=format)
    return lambda m, cal: [
        surgery.quantize(
            m,
            weights=spec,
            method={"name": "autoround", "iterations": 200},
            calibration=[w[None] for b in cal for w in b],
            exclude=HEAD,
            progress=False,
        )
    ]


def _awq(bits: int, method: str = "rtn") -> Recipe:
    grid = GridSpec(bits=bits, group_size=128)
    spec = GridSpec(bits=bits, group_size=128)
    return lambda m, cal: [
        surgery.awq(m, weights=grid, calibration=cal, progress=False),
        surgery.quantize(m, weights=spec, method=method, calibration=cal, exclude=HEAD, progress=False),
    ]


def _activations(bits: int, rotated: bool, dynamic: str | None = "token") -> Recipe:
    def run(m: torch.nn.Module, cal: list) -> list:
        handles = [surgery.rotate(m, calibration=cal)] if rotated else []
        weights = GridSpec(bits=4, group_size=128, symmetric=True)
        activations = GridSpec(bits=bits, symmetric=True, dynamic=dynamic)  # llm-compressor's W4A8/W4A4 inputs
        spec = dict(weights=weights, activations=activations, where="input", exclude=HEAD, progress=False)
        return [*handles, surgery.quantize(m, calibration=cal, **spec)]

    return run


def _prune(method: str, amount: float, pattern: str | None = None, owl: bool = False) -> Recipe:
    def run(m: torch.nn.Module, cal: list) -> list:
        plan = surgery.owl_amounts(m, cal, amount, exclude=HEAD, progress=False) if owl else None
        kwargs = dict(pattern=pattern, amounts=plan, exclude=HEAD, progress=False)
        return [surgery.prune(m, amount, method=method, calibration=cal, **kwargs)]

    return run


FP8 = GridSpec(format="fp8_e4m3")
ACTORDER = 'theirs: GPTQModifier\'s default (actorder="static", an alias of "weight")'
NO_GPTAQ = "ours only: llm-compressor 0.14 has no GPTAQ"
AUTOROUND = "theirs: the auto-round 0.16 package, same settings"
FULL = "full_range"
INT_SYM = "theirs: int_sym, the same grid (ours: observer='full_range')"
AWQ_AUTOROUND = 'theirs: alg_configs="awq,auto_round"'
CLIP_AS_INIT = "ours: the mse search's clipping as the start; theirs: AWQ's, clip_as_init=True"
FLOAT_AUTOROUND = "theirs: nv_fp / mx_fp weights, act_bits=16"
ROWS: list[tuple[str, Recipe | None, str, str]] = [
    ("RTN W4 g128", _quantize(4), "rtn:w4", ""),
    ("GPTQ W4 g128", _quantize(4, "gptq"), "gptq:w4,actorder=none", "both without activation order"),
    ("GPTQ W4 g128, actorder=weight", _quantize(4, "gptq", actorder="weight"), "gptq:w4", ACTORDER),
    ("GPTQ W4 g128, observer=mse", _quantize(4, "gptq", observer="mse"), "gptq:w4,actorder=none,observer=mse", ""),
    ("GPTAQ W4 g128", _quantize(4, "gptaq"), "", NO_GPTAQ),
    ("AutoRound W4 g128 (affine)", _autoround(4, False), "autoround:w4,sym=0", AUTOROUND),
    ("AutoRound W4 g128 (full range)", _autoround(4, False, observer=FULL), "autoround:w4,sym=1", INT_SYM),
    (
        "AutoRound W4 g128 (affine), mse start",
        _autoround(4, False, observer="mse"),
        "autoround:w4,sym=0,awq=1,clip=init",
        CLIP_AS_INIT,
    ),
    ("AWQ + AutoRound W4 g128 (affine)", _autoround(4, False, awq=True), "autoround:w4,sym=0,awq=1", AWQ_AUTOROUND),
    ("AWQ + RTN W4 g128 (affine)", _awq(4), "awq:w4", "llm-compressor: paper scales (duo_scaling=False)"),
    ("RTN W3 g128", _quantize(3), "rtn:w3", ""),
    ("GPTQ W3 g128", _quantize(3, "gptq"), "gptq:w3,actorder=none", "both without activation order"),
    ("GPTQ W3 g128, actorder=weight", _quantize(3, "gptq", actorder="weight"), "gptq:w3", ACTORDER),
    ("GPTQ W3 g128, observer=mse", _quantize(3, "gptq", observer="mse"), "gptq:w3,actorder=none,observer=mse", ""),
    ("GPTAQ W3 g128", _quantize(3, "gptaq"), "", NO_GPTAQ),
    ("AutoRound W3 g128 (affine)", _autoround(3, False), "autoround:w3,sym=0", AUTOROUND),
    ("AutoRound W3 g128 (full range)", _autoround(3, False, observer=FULL), "autoround:w3,sym=1", INT_SYM),
    (
        "AutoRound W3 g128 (affine), mse start",
        _autoround(3, False, observer="mse"),
        "autoround:w3,sym=0,awq=1,clip=init",
        CLIP_AS_INIT,
    ),
    ("AWQ + AutoRound W3 g128 (affine)", _autoround(3, False, awq=True), "autoround:w3,sym=0,awq=1", AWQ_AUTOROUND),
    ("AWQ + RTN W3 g128 (affine)", _awq(3), "awq:w3", "ours also searches clipping; theirs does not"),
    ("AWQ + GPTQ W3 g128 (affine)", _awq(3, "gptq"), "awq-gptq:w3,actorder=none", "both without activation order"),
    ("RTN W2 g64", _quantize(2, group=64), "rtn:w2" + G64, ""),
    ("GPTQ W2 g64", _quantize(2, "gptq", group=64), "gptq:w2,actorder=none" + G64, "both without activation order"),
    (
        "GPTQ W2 g64, observer=mse",
        _quantize(2, "gptq", group=64, observer="mse"),
        "gptq:w2,actorder=none,observer=mse" + G64,
        "",
    ),
    ("GPTAQ W2 g64", _quantize(2, "gptaq", group=64), "", NO_GPTAQ),
    ("AutoRound W2 g64 (affine)", _autoround(2, False, 64), "autoround:w2,sym=0" + G64, AUTOROUND),
    ("AutoRound W2 g64 (full range)", _autoround(2, False, 64, FULL), "autoround:w2,sym=1" + G64, "theirs: W2A16G64"),
    (
        "AutoRound W2 g64 (affine), mse start",
        _autoround(2, False, 64, observer="mse"),
        "autoround:w2,sym=0,awq=1,clip=init" + G64,
        CLIP_AS_INIT,
    ),
    (
        "AWQ + AutoRound W2 g64 (affine)",
        _autoround(2, False, 64, awq=True),
        "autoround:w2,sym=0,awq=1" + G64,
        AWQ_AUTOROUND,
    ),
    (
        "AWQ + AutoRound W2 g64 (full range)",
        _autoround(2, False, 64, FULL, awq=True),
        "autoround:w2,sym=1,awq=1" + G64,
        AWQ_AUTOROUND,
    ),
    ("RTN NVFP4", _float("nvfp4"), "rtn:nvfp4", "theirs: NVFP4A16"),
    ("GPTQ NVFP4", _float("nvfp4", "gptq"), "gptq:nvfp4,actorder=none", "theirs: NVFP4A16, without activation order"),
    ("AutoRound NVFP4", _float_autoround("nvfp4"), "autoround:nvfp4", FLOAT_AUTOROUND),
    ("RTN MXFP4", _float("mxfp4"), "rtn:mxfp4", "theirs: MXFP4A16"),
    ("GPTQ MXFP4", _float("mxfp4", "gptq"), "gptq:mxfp4,actorder=none", "theirs: MXFP4A16, without activation order"),
    ("AutoRound MXFP4", _float_autoround("mxfp4"), "autoround:mxfp4", FLOAT_AUTOROUND),
    ("W4A8 (inputs dynamic per token)", _activations(8, False), "w4a8", ""),
    ("W4A8, rotated", _activations(8, True), "w4a8-rotated", "theirs: SpinQuant R1+R2 Hadamard"),
    ("W4A4 (inputs dynamic per token)", _activations(4, False), "w4a4", ""),
    ("W4A4, rotated", _activations(4, True), "w4a4-rotated", "theirs: SpinQuant R1+R2 Hadamard"),
    ("W4A8, static per-tensor inputs", _activations(8, False, None), "", "ours only: one calibrated scale a layer"),
    ("W4A4, static per-tensor inputs", _activations(4, False, None), "", "ours only: one calibrated scale a layer"),
    ("W4A4, static per-tensor inputs, rotated", _activations(4, True, None), "", "ours only"),
    (
        "FP8 E4M3 (per-tensor weights, static inputs)",
        lambda m, cal: [
            surgery.quantize(
                m, weights=FP8, activations=FP8, where="input", calibration=cal, exclude=HEAD, progress=False
            )
        ],
        "fp8",
        "",
    ),
    ("SparseGPT 50 %", _prune("sparsegpt", 0.5), "sparsegpt:50", ""),
    ("SparseGPT 70 %", _prune("sparsegpt", 0.7), "sparsegpt:70", ""),
    ("SparseGPT 2:4", _prune("sparsegpt", 0.5, "2:4"), "sparsegpt:2:4", ""),
    ("Wanda 50 %", _prune("wanda", 0.5), "wanda:50", ""),
    ("Wanda 70 %", _prune("wanda", 0.7), "wanda:70", ""),
    ("Wanda 2:4", _prune("wanda", 0.5, "2:4"), "wanda:2:4", ""),
    ("OWL + Wanda 50 %", _prune("wanda", 0.5, owl=True), "owl-wanda:50", ""),
    ("OWL + Wanda 70 %", _prune("wanda", 0.7, owl=True), "owl-wanda:70", ""),
]


def ours(name: str, recipe: Recipe | None, model: torch.nn.Module, calibration: list, held_out: list) -> dict | None:
    """Our ``recipe`` on ``model``: its held-out perplexity and seconds, the model restored (None: no recipe)."""
    if recipe is None:
        return None
    before = snapshot(model)
    start = time.perf_counter()
    handles = recipe(model, calibration)
    seconds = time.perf_counter() - start
    found = perplexity(model, held_out)
    for handle in reversed(handles):
        handle.restore()
    if snapshot_differences(before, snapshot(model)):
        raise RuntimeError(f"{name}: restore() did not give the model back")
    return {"perplexity": found, "seconds": seconds}


def theirs(folder: Path, method: str, data: Path) -> dict:
    """llm-compressor's ``method`` (``autoround:...``: the auto-round package's), each in its own venv."""
    peer, script, argument = "llmcompressor", "llmcompressor_quality.py", method
    if method.startswith("autoround:"):
        peer, script, argument = "auto_round", "autoround_quality.py", method.partition(":")[2]
    python = peer_python(peer)
    command = [str(python), str(HERE / script), str(folder), str(data), argument]
    found = subprocess.run(command, capture_output=True, text=True, check=False)
    last = (found.stdout.strip().splitlines() or [""])[-1]
    if found.returncode != 0 or not last.startswith("{"):
        error = [line for line in found.stderr.strip().splitlines() if line and not line.startswith(" ")]
        return {"error": error[-1][:160] if error else f"exit {found.returncode}"}
    return json.loads(last)


def run(peers: bool, only: str | None = None, model_name: str = "tinyllama") -> list[dict]:
    """Every row on the shipped ``model_name`` (``only``: those whose name holds one of its
    comma-separated parts), ours then the peer's (``peers`` False: ours only)."""
    torch.set_num_threads(1)
    folder, load = MODELS[model_name]
    model = load()
    held_out = token_batches("test", 16)
    calibration = [x for x, _ in token_batches("train", 8, limit_batches=4)]  # 32 windows of 128 bytes
    rows = [{"row": "dense", "ours": {"perplexity": perplexity(model, held_out)}}]
    with tempfile.TemporaryDirectory() as temporary:
        data = Path(temporary) / "data.pt"
        torch.save(
            {
                "calibration": torch.cat(calibration),
                "inputs": [x for x, _ in held_out],
                "targets": [y for _, y in held_out],
            },
            data,
        )
        for name, recipe, method, note in ROWS:
            if only is not None and not any(part in name for part in only.split(",")):
                continue
            row = {"row": name, "ours": ours(name, recipe, model, calibration, held_out), "note": note}
            if peers and method:
                row[_peer(method)] = theirs(folder, method, data)
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _cell(found: dict | None) -> str:
    if found is None:
        return "–"
    if "error" in found:
        return f"fails: {found['error']}"
    seconds = f" ({found['seconds']:.1f} s)" if found.get("seconds") else ""
    return f"{found['perplexity']:.3f}{seconds}"


def _peer(method: str) -> str:
    """Whose implementation a peer method name runs."""
    return "auto-round" if method.startswith("autoround:") else "llm-compressor"


def _line(row: dict) -> str:
    peer = row.get("llm-compressor") or row.get("auto-round")
    return f"| {row['row']} | {_cell(row['ours'])} | {_cell(peer)} | {row.get('note', '')} |"


def table(rows: list[dict], model_name: str = "tinyllama") -> str:
    """The rows as a Markdown table: perplexity (seconds) per side."""
    head = f"| {model_name}, held-out perplexity (s) | surgery | peer | note |\n| --- | --- | --- | --- |"
    return "\n".join([head, *(_line(row) for row in rows)])
