"""Benchmark ``surgery.prune`` against ``torch.nn.utils.prune``: inference latency and memory.

Usage::

    .venv/bin/python benchmarks/bench_prune.py            # full run, a few minutes
    .venv/bin/python benchmarks/bench_prune.py --quick    # one to two minutes
    .venv/bin/python benchmarks/bench_prune.py --repeats 300 --json /tmp/bench.json
    .venv/bin/python benchmarks/bench_prune.py --threads 2   # only on an otherwise idle machine

The file holds: the model specs and targets, building the variants (plain, surgery attached,
surgery baked, torch prune attached, Torch-Pruning structural if installed), a round-robin
timer, the memory accounting, and the printed tables. Latency is timed round-robin in a
shuffled order each round, so drift and other processes hit every variant alike; a variant's
ratio is the median over rounds of (variant time / plain time in the same round), with a
bootstrap 95% interval. Torch runs one intra-op thread by default: with two threads on a
shared two-core machine, every forward that loses a core to another process waits a whole
scheduler slice (resnet50 measured 2.5 s instead of 0.11 s). This is a script, not a test:
it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torchvision
from torch import Tensor, nn
from torch.nn.utils import prune as torch_prune
from tqdm import tqdm

import surgery

AMOUNT = 0.5
PRUNED_TYPES = (nn.Conv2d, nn.Linear)
PLAIN, CONTROL, OURS, BAKED = "plain", "plain, 2nd copy (A/A)", "surgery attached", "surgery baked"
TORCH, TP = "torch prune attached", "Torch-Pruning (structural)"


@dataclass(frozen=True)
class Target:
    """A figure printed next to a ratio: ``"max"`` (at most), ``"equal"`` (within 1%) or ``"ref"`` (measured elsewhere)."""

    kind: str
    value: float

    def text(self) -> str:
        return {"max": f"<= {self.value:.2f}x", "equal": f"{self.value:.2f}x", "ref": f"ref {self.value:.2f}x"}[
            self.kind
        ]

    def verdict(self, ratio: float, low: float, high: float) -> str:
        """``ok``/``MISS`` when the interval settles it, ``ok?``/``MISS?`` by the point alone; empty for a reference."""
        if self.kind == "ref":
            return ""
        if self.kind == "equal":  # within 1% of the value
            lo, hi = self.value - 0.01, self.value + 0.01
            if lo <= low and high <= hi:
                return "ok"
            if high < lo or low > hi:
                return "MISS"
            return "ok?" if lo <= ratio <= hi else "MISS?"
        if high <= self.value:
            return "ok"
        if low > self.value:
            return "MISS"
        return "ok?" if ratio <= self.value else "MISS?"


@dataclass
class TimingSpec:
    """What :func:`round_robin` reads (bench_quantize, bench_compile): a name, rounds, warm-up calls and a time cap."""

    name: str
    rounds: int
    warmup: int
    max_seconds: float


@dataclass
class ModelSpec:
    """One benchmarked model: how to build it, its input, how long to time it, its targets."""

    name: str
    build: Callable[[], nn.Module]
    make_input: Callable[[], Tensor]
    rounds: int
    warmup: int
    max_seconds: float
    latency_targets: dict[str, Target]
    memory_targets: dict[str, Target] = field(
        default_factory=lambda: {TORCH: Target("ref", 2.99), OURS: Target("max", 1.6), BAKED: Target("equal", 1.0)}
    )


@dataclass
class Latency:
    """Per-call latency of one variant and its ratio to plain, paired by round."""

    median_ms: float
    p25_ms: float
    p75_ms: float
    ratio: float
    ratio_low: float
    ratio_high: float
    ratio_of_medians: float


@dataclass
class Memory:
    """Bytes a variant holds: params + buffers of the model, plus other tensors it keeps alive."""

    params_buffers: int
    extra: int
    extra_what: str
    ratio: float = 0.0


@dataclass
class VariantResult:
    name: str
    apply_s: list[float]
    latency: Latency | None = None
    memory: Memory | None = None


@dataclass
class ModelResult:
    model: str
    calls_per_sample: int
    copies: int
    rounds: int
    timing_s: float
    checks: list[str]
    variants: dict[str, VariantResult]


def mlp() -> nn.Module:
    """The 784-1024-1024-1024-10 ReLU MLP."""
    sizes = [784, 1024, 1024, 1024, 10]
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def specs(args: argparse.Namespace) -> list[ModelSpec]:
    quick = args.quick
    cap = args.max_seconds if args.max_seconds is not None else (float("inf") if args.repeats else None)
    resnet = ModelSpec(
        "resnet50",
        lambda: torchvision.models.resnet50(weights=None),
        lambda: torch.randn(1, 3, 224, 224),
        rounds=args.repeats or (25 if quick else 200),
        warmup=2 if quick else 5,
        max_seconds=cap or (25.0 if quick else 150.0),
        latency_targets={
            CONTROL: Target("equal", 1.0),
            TORCH: Target("ref", 1.23),
            OURS: Target("max", 1.03),
            BAKED: Target("equal", 1.0),
        },
    )
    small = ModelSpec(
        "mlp 784-1024x3-10",
        mlp,
        lambda: torch.randn(32, 784),
        rounds=args.repeats or (150 if quick else 1000),
        warmup=10 if quick else 30,
        max_seconds=cap or (10.0 if quick else 45.0),
        latency_targets={
            CONTROL: Target("equal", 1.0),
            TORCH: Target("ref", 1.63),
            OURS: Target("max", 1.10),
            BAKED: Target("equal", 1.0),
        },
    )
    chosen = {"resnet50": [resnet], "mlp": [small], "all": [resnet, small]}[args.models]
    return chosen


# --- building the variants -----------------------------------------------------------------


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def apply_torch_prune(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, PRUNED_TYPES):
            torch_prune.l1_unstructured(module, "weight", amount=AMOUNT)
    return model


def apply_torch_pruning(model: nn.Module, example: Tensor) -> nn.Module | None:
    """Torch-Pruning's L1 channel pruning at the same ratio (removes channels: a different thing)."""
    try:
        import torch_pruning as tp
    except ImportError:
        return None
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]  # keep the class count
    pruner = tp.pruner.BasePruner(
        model, example, importance=tp.importance.MagnitudeImportance(p=1), pruning_ratio=AMOUNT, ignored_layers=[last]
    )
    pruner.step()
    return model


def on_copies(
    base: nn.Module, apply: Callable[[nn.Module], object], count: int
) -> list[tuple[float, nn.Module, object]]:
    """Run ``apply`` on ``count`` fresh deep copies of ``base``: (seconds, copy, result) each; copying is not timed."""
    runs = []
    for _ in range(count):
        model = copy.deepcopy(base)
        seconds, out = timed(lambda: apply(model))
        runs.append((seconds, model, out))
    return runs


def build_variants(
    base: nn.Module, example: Tensor, copies: int
) -> tuple[dict[str, list[nn.Module]], dict[str, VariantResult], surgery.PruneHandle]:
    """``copies`` independent copies of ``base`` under each method, apply times taken on each.

    Several copies per variant average out where each copy's tensors landed in memory, which
    moves a forward's time by about 1% and would otherwise bias a ratio. ``surgery.prune`` runs
    first: for the first model, its first timing is the first call in the process.
    """
    ours = on_copies(base, lambda model: surgery.prune(model, AMOUNT), 2 * copies)
    torch_runs = on_copies(base, apply_torch_prune, copies)
    attached, baked = ours[:copies], ours[copies:]
    models = {
        PLAIN: [copy.deepcopy(base) for _ in range(copies)],
        CONTROL: [copy.deepcopy(base) for _ in range(copies)],
        OURS: [m for _, m, _ in attached],
        BAKED: [m for _, m, _ in baked],
        TORCH: [m for _, m, _ in torch_runs],
    }
    results = {
        PLAIN: VariantResult(PLAIN, []),
        CONTROL: VariantResult(CONTROL, []),
        OURS: VariantResult(OURS, [t for t, _, _ in ours]),
        BAKED: VariantResult(BAKED, [timed(handle.bake)[0] for _, _, handle in baked]),
        TORCH: VariantResult(TORCH, [t for t, _, _ in torch_runs]),
    }
    seconds, structural = timed(lambda: apply_torch_pruning(copy.deepcopy(base), example))
    if structural is None:
        print(
            "note: torch_pruning is not installed; skipping Torch-Pruning "
            "(install with: .venv/bin/pip install torch-pruning)"
        )
    else:
        models[TP] = [structural.eval()] + [copy.deepcopy(structural) for _ in range(copies - 1)]
        results[TP] = VariantResult(TP, [seconds])
    return models, results, attached[0][2]


def sanity_checks(models: dict[str, nn.Module], handle: surgery.PruneHandle, example: Tensor) -> list[str]:
    """Check the variants compute what they should, so the timings compare like with like."""
    modules = dict(models[TORCH].named_modules())
    ours = handle.masks()
    same = sum(torch.equal(mask, modules[name.rsplit(".", 1)[0]].weight_mask.bool()) for name, mask in ours.items())
    with torch.no_grad():
        outs = {name: model(example) for name, model in models.items()}
    lines = [
        f"masks identical, surgery vs torch prune: {same}/{len(ours)} layers; surgery sparsity {handle.sparsity():.4f}",
        f"outputs: attached == baked bit-exact: {torch.equal(outs[OURS], outs[BAKED])}; "
        f"max |surgery - torch prune| = {(outs[OURS] - outs[TORCH]).abs().max().item():.3g}; "
        f"max |plain - surgery| = {(outs[PLAIN] - outs[OURS]).abs().max().item():.3g}",
    ]
    return lines


# --- timing ---------------------------------------------------------------------------------


def calls_per_sample(model: nn.Module, example: Tensor, target_s: float = 0.005) -> int:
    """How many forward calls make one timed sample of about ``target_s`` seconds."""
    with torch.no_grad():
        model(example)
        seconds = min(timed(lambda: model(example))[0] for _ in range(5))
    return max(1, round(target_s / seconds))


def round_robin(
    models: dict[str, list[nn.Module]], example: Tensor, spec: ModelSpec, inner: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Per-call seconds of each variant, one sample per variant per round, shuffled each round.

    Round ``r`` times copy ``r % copies`` of every variant.
    """
    names = list(models)
    samples: dict[str, list[float]] = {name: [] for name in names}
    deadline = time.monotonic() + spec.max_seconds
    with torch.no_grad():
        for _ in range(spec.warmup):
            for copies in models.values():
                for model in copies:
                    model(example)
        gc.collect()
        gc.disable()
        try:
            for round_ in tqdm(
                range(spec.rounds), desc=f"timing {spec.name}", unit="round", file=sys.stderr, leave=False
            ):
                for index in rng.permutation(len(names)):
                    copies = models[names[index]]
                    model = copies[round_ % len(copies)]
                    start = time.perf_counter_ns()
                    for _ in range(inner):
                        model(example)
                    samples[names[index]].append((time.perf_counter_ns() - start) / inner / 1e9)
                if time.monotonic() > deadline:
                    break
        finally:
            gc.enable()
    return {name: np.asarray(values) for name, values in samples.items()}


def latency(times: np.ndarray, plain: np.ndarray, rng: np.random.Generator, boot: int = 2000) -> Latency:
    paired = times / plain
    draws = np.median(paired[rng.integers(0, len(paired), size=(boot, len(paired)))], axis=1)
    low, high = np.percentile(draws, [2.5, 97.5])
    p25, p50, p75 = np.percentile(times, [25, 50, 75]) * 1e3
    return Latency(
        float(p50),
        float(p25),
        float(p75),
        float(np.median(paired)),
        float(low),
        float(high),
        float(np.median(times) / np.median(plain)),
    )


def dispatch_cost(repeats: int = 2000) -> float:
    """Extra seconds a module call costs once it has a forward-pre hook (the slow call path)."""
    module, example = nn.Identity(), torch.zeros(1)

    def per_call() -> float:
        return min(timed(lambda: [module(example) for _ in range(repeats)])[0] for _ in range(5)) / repeats

    bare = per_call()
    hook = module.register_forward_pre_hook(lambda mod, args: None)
    hooked = per_call()
    hook.remove()
    return max(hooked - bare, 0.0)


def hook_cost(model: nn.Module, plain_best_s: float, dispatch_s: float, repeats: int = 20) -> str:
    """Load-robust floor of the attached overhead: every forward-pre hook called directly (best of ``repeats``).

    Reads the modules' private ``_forward_pre_hooks`` dicts; measurement only.
    """
    calls = [(module, hook) for module in model.modules() for hook in module._forward_pre_hooks.values()]
    hooked = sum(1 for module in model.modules() if module._forward_pre_hooks)
    with torch.no_grad():
        direct = min(timed(lambda: [hook(module, ()) for module, hook in calls])[0] for _ in range(repeats))
    total = direct + hooked * dispatch_s
    return (
        f"hook cost, {OURS} (load-robust): {len(calls)} pre-hooks on {hooked} modules, "
        f"called directly {direct * 1e6:.0f} us "
        f"+ dispatch {hooked} x {dispatch_s * 1e6:.1f} us = {total * 1e6:.0f} us per forward "
        f"= {total / plain_best_s * 100:.2f}% of plain's fastest forward"
    )


# --- memory ---------------------------------------------------------------------------------


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor and its views count once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def state_tensors(model: nn.Module) -> list[Tensor]:
    return [*model.parameters(), *model.buffers()]


def memory_plain(model: nn.Module) -> Memory:
    return Memory(storage_bytes(state_tensors(model)), 0, "nothing else")


def memory_torch_prune(model: nn.Module) -> Memory:
    """Params (``weight_orig``) + buffers (``weight_mask``) + the recomputed plain ``weight`` attributes."""
    state = state_tensors(model)
    recomputed = [m.weight for m in model.modules() if hasattr(m, "weight_orig")]
    base = storage_bytes(state)
    return Memory(
        base,
        storage_bytes(state + recomputed) - base,
        f"{len(recomputed)} recomputed `weight` tensors (masks are float buffers, counted in params+buffers)",
    )


def memory_ours(model: nn.Module, handle: surgery.PruneHandle) -> tuple[Memory, str]:
    """Params + buffers + packed masks + saved originals (pruned entries x element size).

    The saved originals live in the handle's undo records (``handle.records``); their size is
    computed, then cross-checked against the tensors those records hold.
    """
    state = state_tensors(model)
    base = storage_bytes(state)
    packed = storage_bytes(e.packed for e in handle.enforcers.values())
    saved = sum(int((~r.transform.mask()).sum()) * r.param.element_size() for r in handle.records)
    walked = (
        storage_bytes(state + [e.packed for e in handle.enforcers.values()] + record_tensors(handle)) - base - packed
    )
    check = f"saved originals: computed {saved / 2**20:.2f} MiB, found in undo records {walked / 2**20:.2f} MiB"
    what = f"{len(handle.enforcers)} packed masks {packed / 2**20:.2f} MiB + saved originals {saved / 2**20:.2f} MiB"
    return Memory(base, packed + saved, what), check


def record_tensors(handle: surgery.Handle) -> list[Tensor]:
    """The tensors the handle's undo records keep (``AttachedTransform.saved``)."""
    return [tensor for record in handle.records for tensor in record.saved.tensors()]


def measure_memory(
    models: dict[str, nn.Module], results: dict[str, VariantResult], handle: surgery.PruneHandle
) -> list[str]:
    results[PLAIN].memory = memory_plain(models[PLAIN])
    results[CONTROL].memory = memory_plain(models[CONTROL])
    results[OURS].memory, check = memory_ours(models[OURS], handle)
    results[BAKED].memory = memory_plain(models[BAKED])
    results[TORCH].memory = memory_torch_prune(models[TORCH])
    if TP in models:
        results[TP].memory = memory_plain(models[TP])
    plain = results[PLAIN].memory.params_buffers
    for result in results.values():
        result.memory.ratio = (result.memory.params_buffers + result.memory.extra) / plain
    return [check]


# --- one model, then the tables -------------------------------------------------------------


def run_model(spec: ModelSpec, args: argparse.Namespace, rng: np.random.Generator) -> ModelResult:
    torch.manual_seed(0)
    base, example = spec.build().eval(), spec.make_input()
    models, results, handle = build_variants(base, example, args.copies)
    firsts = {name: copies[0] for name, copies in models.items()}
    checks = sanity_checks(firsts, handle, example) + measure_memory(firsts, results, handle)
    inner = calls_per_sample(firsts[PLAIN], example)
    start = time.perf_counter()
    samples = round_robin(models, example, spec, inner, rng)
    seconds = time.perf_counter() - start
    for name, times in samples.items():
        results[name].latency = latency(times, samples[PLAIN], rng)
    checks.append(hook_cost(firsts[OURS], float(samples[PLAIN].min()), dispatch_cost()))
    return ModelResult(spec.name, inner, args.copies, len(samples[PLAIN]), seconds, checks, results)


def fmt_apply(values: list[float], digits: int = 3) -> str:
    """Apply seconds: the first (cold) call, then the median of the others."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values[0]:.{digits}f} / {np.median(values[1:]):.{digits}f}"


def print_model(result: ModelResult, spec: ModelSpec) -> None:
    print(
        f"\n== {result.model}: {result.rounds} rounds x {result.calls_per_sample} call(s) per sample, "
        f"{result.copies} copies per variant, "
        f"timed for {result.timing_s:.0f} s =="
    )
    for line in result.checks:
        print(f"  check: {line}")
    header = (
        f"  {'variant':<28}{'median ms':>10}{'p25-p75 ms':>17}{'ratio [95% CI]':>22}{'target':>12}{'':>6}"
        f"{'mem ratio':>10}{'target':>10}{'':>6}{'apply s':>16}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for name, v in result.variants.items():
        lat, mem = v.latency, v.memory
        lt, mt = spec.latency_targets.get(name), spec.memory_targets.get(name)
        print(
            f"  {name:<28}{lat.median_ms:>10.2f}{f'{lat.p25_ms:.2f}-{lat.p75_ms:.2f}':>17}"
            f"{f'{lat.ratio:.3f} [{lat.ratio_low:.3f},{lat.ratio_high:.3f}]':>22}"
            f"{lt.text() if lt else '':>12}{lt.verdict(lat.ratio, lat.ratio_low, lat.ratio_high) if lt else '':>6}"
            f"{f'{mem.ratio:.2f}x':>10}{mt.text() if mt else '':>10}"
            f"{mt.verdict(mem.ratio, mem.ratio, mem.ratio) if mt else '':>6}{fmt_apply(v.apply_s):>16}"
        )
    print("  memory counted (bytes of distinct storages):")
    for name, v in result.variants.items():
        mem = v.memory
        print(
            f"    {name:<28}params+buffers {mem.params_buffers / 2**20:7.2f} MiB "
            f"+ {mem.extra / 2**20:6.2f} MiB: {mem.extra_what}"
        )


def print_legend() -> None:
    print(
        "\nlegend: ratio = median over rounds of (variant / plain in the same round), CI = bootstrap 95% "
        "of that median; "
        "ok/MISS = the whole CI meets/misses the target, ok?/MISS? = only the point does (CI straddles it); "
        "1.00x means within 1%; 'ref' = torch prune figure measured elsewhere, for comparison. "
        "The A/A row is a second set of plain copies: its distance from 1.000 shows the error left from "
        "where copies sit in memory. "
        "apply s = first call / median of the later ones, one per copy (surgery.prune runs first). "
        "Torch-Pruning removes whole channels (structural): a "
        "different, smaller model, listed for scale only. Baked memory excludes the handle, which after "
        f"bake() still holds its packed masks until it is dropped. amount={AMOUNT}, eval(), no_grad."
    )


def add_shared_arguments(parser: argparse.ArgumentParser) -> None:
    """``--threads`` and ``--copies``, as every round-robin benchmark takes them."""
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine, 2 threads make a "
        "forward wait whole scheduler slices whenever another process runs)",
    )
    parser.add_argument(
        "--copies",
        type=int,
        default=None,
        help="independent copies of each variant, timed in turn (default 3, 2 with --quick)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (one to two minutes)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timing rounds per model (default 200 resnet50, 1000 mlp; 25/150 with --quick); "
        "given explicitly, no time cap applies unless --max-seconds is given too",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop timing a model after this many seconds (default 150 resnet50, 45 mlp; 25/10 with --quick)",
    )
    parser.add_argument("--models", choices=["all", "resnet50", "mlp"], default="all")
    add_shared_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 5:
        parser.error("--repeats must be at least 5")
    if args.copies is None:
        args.copies = 2 if args.quick else 3
    if args.copies < 1:
        parser.error("--copies must be at least 1")
    return args


def setup_threads(threads: int) -> None:
    """Fix torch's thread counts and print the environment the figures come from."""
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    print(
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()} (interop {torch.get_num_interop_threads()}), "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_threads(args.threads)
    started = time.perf_counter()
    if os.getloadavg()[0] > 1.0 and args.threads > 1:
        print(
            "warning: other processes are using the CPUs; with several torch threads a forward that loses "
            "a core waits a whole scheduler slice, so times stretch and turn bimodal: prefer --threads 1"
        )
    rng = np.random.default_rng(0)
    runs = [(spec, run_model(spec, args, rng)) for spec in specs(args)]
    for spec, result in runs:
        print_model(result, spec)
    print_legend()
    total = time.perf_counter() - started
    print(
        f"\ntotal {total:.0f} s, load average at end {os.getloadavg()[0]:.2f}"
        + (
            " (other processes were competing for the CPUs: expect wider intervals)"
            if os.getloadavg()[0] > args.threads + 0.5
            else ""
        )
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"threads": args.threads, "total_s": total, "models": [asdict(r) for _, r in runs]}, out, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
