"""Benchmark surgery under ``torch.compile``: graph breaks, compile time, latency against compiled plain.

Usage::

    .venv/bin/python benchmarks/bench_compile.py            # about 6 minutes
    .venv/bin/python benchmarks/bench_compile.py --quick    # about 2 minutes (no cold compile times)
    .venv/bin/python benchmarks/bench_compile.py --json /tmp/bench.json

On torchvision resnet18 (batch 1, 224x224, eval, no_grad, inductor, default mode) it builds:
the plain model, a second plain copy (A/A), ``surgery.prune(model, 0.5)`` attached, surgery
W8A8 attached (int8 per-channel symmetric weights, uint8 per-tensor activations on every
Conv2d/Linear output), the prune baked, and a "rejected design" row: the pruned model with a
forward-pre hook on every layer that re-applies the boolean mask in place on every call (what
skipping surgery's version check and re-applying inside the graph would compile to). For each
it reports the graphs and graph breaks ``torch._dynamo.explain`` finds, the cold compile time
(first call in a fresh process with inductor's on-disk caches off), whether the compiled output equals the eager one, and the latency of
the compiled variant relative to the compiled plain model, timed round-robin as in
``bench_prune.py`` (whose helpers it imports): a shuffled order each round, the median of
paired per-round ratios with a bootstrap 95% interval, one torch thread. It also times the
eager plain model for scale. It is a script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torchvision
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prune import Latency, TimingSpec, calls_per_sample, latency, round_robin, setup_threads

import surgery

PLAIN, CONTROL, EAGER = "compiled plain", "compiled plain, 2nd copy (A/A)", "eager plain (for scale)"
PRUNED, W8A8, BAKED = "prune 0.5 attached", "W8A8 attached", "prune 0.5 baked"
REAPPLY = "rejected: re-apply mask in graph each call"
TYPES = (nn.Conv2d, nn.Linear)


@dataclass
class VariantResult:
    name: str
    graphs: int | None = None
    graph_breaks: int | None = None
    compile_s: float | None = None
    max_abs_vs_eager: float | None = None
    cosine_vs_eager: float | None = None
    latency: Latency | None = None


class ReapplyMask:
    """Forward-pre hook re-applying a boolean mask in place on every call (the rejected design)."""

    def __init__(self, pruned: Tensor) -> None:
        self.pruned = pruned

    def __call__(self, module: nn.Module, args: tuple) -> None:
        with torch.no_grad():
            module.weight.masked_fill_(self.pruned, 0)


def build_variants(base: nn.Module, example: Tensor) -> tuple[dict[str, nn.Module], list[surgery.Handle]]:
    """Eager models for every variant (surgery attached where it applies) and the handles."""
    models = {PLAIN: copy.deepcopy(base), CONTROL: copy.deepcopy(base)}
    models[PRUNED] = copy.deepcopy(base)
    pruning = surgery.prune(models[PRUNED], 0.5)
    models[W8A8] = copy.deepcopy(base)
    quantizing = surgery.quantize(
        models[W8A8],
        activations=surgery.GridSpec(bits=8),
        calibration=[torch.randn_like(example) for _ in range(4)],
        progress=False,
    )
    models[BAKED] = copy.deepcopy(base)
    surgery.prune(models[BAKED], 0.5).bake()  # the same masks: L1 on the same weights
    models[REAPPLY] = copy.deepcopy(base)
    modules = dict(models[REAPPLY].named_modules())
    with torch.no_grad():
        for name, mask in pruning.masks().items():
            layer = modules[name.removesuffix(".weight")]
            layer.weight.masked_fill_(~mask, 0)
            layer.register_forward_pre_hook(ReapplyMask(~mask))
    return models, [pruning, quantizing]


def explain(model: nn.Module, example: Tensor) -> tuple[int, int]:
    torch._dynamo.reset()
    with torch.no_grad():
        found = torch._dynamo.explain(model)(example)
    return found.graph_count, found.graph_break_count


def base_model() -> tuple[nn.Module, Tensor]:
    example = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torchvision.models.resnet18().eval(), example


def cold_compile_seconds(name: str) -> float:
    """First call of ``torch.compile`` on variant ``name``, in a fresh process with inductor's disk
    caches off (a process compiles shared kernels once: later variants would look cheaper)."""
    done = subprocess.run(
        [sys.executable, __file__, "--cold-compile", name], capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


def time_cold_compile(name: str, threads: int) -> None:
    """The child process of :func:`cold_compile_seconds`: prints the seconds."""
    from torch._inductor import config as inductor_config

    torch.set_num_threads(threads)
    base, example = base_model()
    models, _ = build_variants(base, example)
    with inductor_config.patch(force_disable_caches=True), torch.no_grad():
        start = time.perf_counter()
        torch.compile(models[name])(example)
        print(time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict[str, VariantResult]:
    torch._dynamo.config.recompile_limit = 64  # one compiled entry per variant and copy
    base, example = base_model()
    models, handles = build_variants(base, example)
    results = {name: VariantResult(name) for name in [EAGER, *models]}
    for name, model in models.items():
        results[name].graphs, results[name].graph_breaks = explain(model, example)
        print(f"{name}: {results[name].graphs} graph(s), {results[name].graph_breaks} break(s)", file=sys.stderr)
    if not args.quick:
        for name in [PLAIN, PRUNED, W8A8, REAPPLY]:
            results[name].compile_s = cold_compile_seconds(name)
            print(f"{name}: cold compile {results[name].compile_s:.1f} s", file=sys.stderr)
    torch._dynamo.reset()
    compiled = {name: torch.compile(model) for name, model in models.items()}
    with torch.no_grad():
        for name, model in compiled.items():
            got, expected = model(example), models[name](example)
            results[name].max_abs_vs_eager = float((got - expected).abs().max())
            results[name].cosine_vs_eager = float(torch.nn.functional.cosine_similarity(got, expected).min())
    timed = {EAGER: [models[PLAIN]], **{name: [model] for name, model in compiled.items()}}
    inner = calls_per_sample(compiled[PLAIN], example, target_s=0.05)
    spec = TimingSpec("resnet18 compiled", args.repeats, warmup=3, max_seconds=args.max_seconds)
    times = round_robin(timed, example, spec, inner, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    for name, values in times.items():
        results[name].latency = latency(values, times[PLAIN], rng)
    for handle in reversed(handles):
        handle.restore()
    return results


def print_results(results: dict[str, VariantResult]) -> None:
    print("\nresnet18, batch 1, 224x224, inductor, 1 thread")
    print(
        f"{'variant':45s} {'graphs':>6s} {'breaks':>6s} {'compile':>8s} {'vs eager':>22s} "
        f"{'median':>9s} {'vs compiled plain [95% CI]':>28s}"
    )
    for result in results.values():
        lat = result.latency
        compile_s = f"{result.compile_s:.1f} s" if result.compile_s is not None else "-"
        graphs = "-" if result.graphs is None else str(result.graphs)
        breaks = "-" if result.graph_breaks is None else str(result.graph_breaks)
        exact = (
            "-"
            if result.max_abs_vs_eager is None
            else ("exact" if result.max_abs_vs_eager == 0 else f"{result.max_abs_vs_eager:.1e}")
        )
        if result.cosine_vs_eager is not None and result.max_abs_vs_eager:
            exact += f" (cos {result.cosine_vs_eager:.6f})"
        ratio = f"{lat.ratio:.3f}x [{lat.ratio_low:.3f}, {lat.ratio_high:.3f}]" if lat else "-"
        median = f"{lat.median_ms:.1f} ms" if lat else "-"
        print(f"{result.name:45s} {graphs:>6s} {breaks:>6s} {compile_s:>8s} {exact:>22s} {median:>9s} {ratio:>28s}")
    print(
        "\ngraphs/breaks: torch._dynamo.explain; compile: cold first call (fresh process, inductor disk "
        "caches off); vs eager: max |compiled - eager| of the same variant's logits (cosine); ratio: median over rounds of "
        "variant time / compiled plain time in the same round"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run, no cold compile times")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds (default 150, 15 with --quick)")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop timing after this many seconds (default 150, 40 with --quick)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--cold-compile", metavar="VARIANT", help=argparse.SUPPRESS)  # child process
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (15 if args.quick else 150)
    args.max_seconds = args.max_seconds or (40.0 if args.quick else 150.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cold_compile:
        time_cold_compile(args.cold_compile, args.threads)
        return 0
    setup_threads(args.threads)
    started = time.perf_counter()
    results = run(args)
    print_results(results)
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average at end {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: asdict(v) for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
