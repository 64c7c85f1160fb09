"""Benchmark ``surgery.quantize`` against ``torch.ao.quantization.FakeQuantize``: latency, exactness, accuracy.

Usage::

    .venv/bin/python benchmarks/bench_quantize.py            # full run, about 4 minutes
    .venv/bin/python benchmarks/bench_quantize.py --quick    # about 1.5 minutes
    .venv/bin/python benchmarks/bench_quantize.py --repeats 200 --json /tmp/bench.json
    .venv/bin/python benchmarks/bench_quantize.py --threads 2   # only on an otherwise idle machine

On torchvision resnet50 (batch 1, 224x224, eval, no_grad) it times, against the plain model:
int8 per-tensor affine activation fake-quant on every Conv2d/Linear output with ``surgery``
(attached), the same with ``FakeQuantize`` modules wrapped around those layers (observer
disabled after calibration, and observer left enabled), surgery W8A8 attached, and surgery
W8 weights baked. Before timing it checks that surgery's quantized outputs are exactly
``torch.fake_quantize_per_tensor_affine`` of the raw outputs with surgery's scale and zero
point, that both methods found the same scales and zero points, and how far their model
outputs are apart. It then splits the activation overhead into the fake-quant kernel and the
hook's Python path (each called directly, best of several: robust to load), and, if
``surgery.tasks.digits`` is present, measures accuracy on the offline digits test split.

Timing follows ``bench_prune.py`` (whose helpers it imports): several copies per variant,
round-robin in a shuffled order each round, a variant's ratio is the median over rounds of
(variant time / plain time in the same round) with a bootstrap 95% interval, an A/A row of
plain copies, one torch thread by default. It is a script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torchvision
from torch import Tensor, nn
from torch.ao.quantization import FakeQuantize, MinMaxObserver

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prune import (  # noqa: E402
    Latency,
    Target,
    TimingSpec,
    add_shared_arguments,
    calls_per_sample,
    fmt_apply,
    latency,
    on_copies,
    round_robin,
    setup_threads,
    timed,
)

import surgery  # noqa: E402
from surgery.ops.quantization.quantization import ActivationQuantizer  # noqa: E402

TYPES = (nn.Conv2d, nn.Linear)
A8 = surgery.GridSpec(bits=8)  # unsigned [0, 255], affine, per tensor, min/max observer
PLAIN, CONTROL = "plain", "plain, 2nd copy (A/A)"
OURS, TORCH_OFF, TORCH_ON = "surgery A8 attached", "torch FakeQuantize, obs. off", "torch FakeQuantize, obs. on"
W8A8, W8_BAKED = "surgery W8A8 attached", "surgery W8 baked"
WHAT_IF = "what-if: arithmetic A8 hook"
TARGETS = {
    CONTROL: Target("equal", 1.0),
    OURS: Target("max", 1.10),
    TORCH_ON: Target("ref", 1.76),
    W8_BAKED: Target("equal", 1.0),
}
DIGITS_MAX_DROP = 0.5  # accuracy points, W8A8 vs float


@dataclass
class VariantResult:
    name: str
    apply_s: list[float]
    latency: Latency | None = None


@dataclass
class Result:
    model: str
    calls_per_sample: int
    copies: int
    rounds: int
    timing_s: float
    checks: list[str]
    costs: list[str]
    variants: dict[str, VariantResult]
    digits: dict[str, float] = field(default_factory=dict)
    digits_note: str = ""


# --- the torch.ao side: FakeQuantize after every Conv2d/Linear ---------------------------------


class FakeQuantized(nn.Module):
    """``fake_quant(inner(x))``: a layer followed by a ``FakeQuantize`` of its output."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        # surgery's A8: [0, 255] affine per tensor from running min/max, the formulas of torch.ao.
        # (FakeQuantize()'s default observer is MovingAverageMinMaxObserver: the same per-call work
        # as MinMaxObserver, but different scales from a min/max calibration.)
        self.fake_quant = FakeQuantize(
            observer=MinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8, qscheme=torch.per_tensor_affine
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.fake_quant(self.inner(x))


def wrap_fake_quantize(model: nn.Module) -> dict[str, FakeQuantized]:
    """Replace every Conv2d/Linear of ``model`` by a :class:`FakeQuantized` of it; by original name."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, TYPES)]
    wrapped = {}
    for name, module in targets:
        parent, _, attr = name.rpartition(".")
        wrapped[name] = FakeQuantized(module)
        setattr(model.get_submodule(parent) if parent else model, attr, wrapped[name])
    return wrapped


def torch_fake_quantize(model: nn.Module, calibration: list[Tensor]) -> nn.Module:
    """Wrap, observe the calibration batches without fake-quantizing (as surgery's calibration
    does, so downstream layers see float inputs), then fake-quantize with the observer off."""
    wrapped = wrap_fake_quantize(model)
    model.apply(torch.ao.quantization.disable_fake_quant)
    model.apply(torch.ao.quantization.enable_observer)
    with torch.no_grad():
        for batch in calibration:
            model(batch)
    model.apply(torch.ao.quantization.enable_fake_quant)
    model.apply(torch.ao.quantization.disable_observer)
    return wrapped


def observer_on(model: nn.Module) -> nn.Module:
    """A calibrated wrapped model with its observers switched back on (QAT-style forward)."""
    model.apply(torch.ao.quantization.enable_observer)
    return model


# --- a what-if: the same hook with the fused op replaced by vectorized arithmetic ---------------


def arithmetic_fake_quantize(x: Tensor, scale: float, inv_scale: float, low: float, high: float) -> Tensor:
    """``fake_quantize_per_tensor_affine`` for finite x as 4 vectorized passes, no mask, no autograd
    rule: ``(clamp(round(x * inv), qmin - zp, qmax - zp)) * scale`` with inv = float32(1 / scale),
    as the fused kernel computes it (NaN would stay NaN here, the kernel maps it to qmin)."""
    return torch.mul(x, inv_scale).round_().clamp_(low, high).mul_(scale)


class ArithmeticHook:
    """Forward hook with surgery's frozen qparams, precomputed once, applying the arithmetic path."""

    def __init__(self, quantizer: ActivationQuantizer) -> None:
        quant_min, quant_max = quantizer.spec.quant_range
        self.zero_point = int(quantizer.zero_point)
        self.scale = float(quantizer.scale)
        self.inv_scale = float(torch.ones((), dtype=torch.float32) / quantizer.scale.float())
        self.low, self.high = float(quant_min - self.zero_point), float(quant_max - self.zero_point)

    def apply(self, x: Tensor) -> Tensor:
        return arithmetic_fake_quantize(x, self.scale, self.inv_scale, self.low, self.high)

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return self.apply(output)


def what_if(model: nn.Module, handle: surgery.QuantizeHandle) -> nn.Module:
    for name, quantizer in handle.activations.items():
        model.get_submodule(name).register_forward_hook(ArithmeticHook(quantizer))
    return model


# --- building the variants ---------------------------------------------------------------------


def build_variants(base: nn.Module, calibration: list[Tensor], copies: int, with_what_if: bool):
    """``copies`` independent copies of each variant, with apply times (surgery runs first)."""

    def ours(model):
        return surgery.quantize(model, weights=None, activations=A8, calibration=calibration, progress=False)

    def w8a8(model):
        return surgery.quantize(model, activations=A8, calibration=calibration, progress=False)

    def w8_baked(model):
        return surgery.quantize(model, progress=False).bake()

    runs = {
        OURS: on_copies(base, ours, copies),
        W8A8: on_copies(base, w8a8, copies),
        W8_BAKED: on_copies(base, w8_baked, copies),
        TORCH_OFF: on_copies(base, lambda model: torch_fake_quantize(model, calibration), copies),
    }
    handle = runs[OURS][0][2]
    models = {
        PLAIN: [copy.deepcopy(base) for _ in range(copies)],
        CONTROL: [copy.deepcopy(base) for _ in range(copies)],
        **{name: [m for _, m, _ in done] for name, done in runs.items()},
    }
    results = {
        PLAIN: VariantResult(PLAIN, []),
        CONTROL: VariantResult(CONTROL, []),
        **{name: VariantResult(name, [t for t, _, _ in done]) for name, done in runs.items()},
    }
    models[TORCH_ON] = [observer_on(copy.deepcopy(m)) for m in models[TORCH_OFF]]
    results[TORCH_ON] = VariantResult(TORCH_ON, [])
    if with_what_if:
        models[WHAT_IF] = [what_if(copy.deepcopy(base), handle) for _ in range(copies)]
        results[WHAT_IF] = VariantResult(WHAT_IF, [])
    order = [PLAIN, CONTROL, OURS, TORCH_OFF, TORCH_ON, W8A8, W8_BAKED, WHAT_IF]
    return (
        {n: models[n] for n in order if n in models},
        {n: results[n] for n in order if n in results},
        handle,
        runs[TORCH_OFF][0][2],
    )


# --- checks before timing ----------------------------------------------------------------------


def capture(model: nn.Module, names: list[str], example: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """Each named layer's output before and after the hooks surgery put on it, and the model output."""
    raw, final, hooks = {}, {}, []
    for name in names:
        module = model.get_submodule(name)
        hooks.append(module.register_forward_hook(lambda m, a, out, n=name: raw.__setitem__(n, out), prepend=True))
        hooks.append(module.register_forward_hook(lambda m, a, out, n=name: final.__setitem__(n, out)))
    try:
        with torch.no_grad():
            out = model(example)
    finally:
        for hook in hooks:
            hook.remove()
    return raw, final, out


def sanity_checks(
    models: dict[str, nn.Module], handle: surgery.QuantizeHandle, wrapped: dict[str, FakeQuantized], example: Tensor
) -> tuple[list[str], dict[str, Tensor]]:
    names = list(handle.activations)
    raw, final, ours_out = capture(models[OURS], names, example)
    quant_min, quant_max = A8.quant_range
    exact, worst = 0, 0.0
    for name in names:
        q = handle.activations[name]
        reference = torch.fake_quantize_per_tensor_affine(raw[name], q.scale, q.zero_point, quant_min, quant_max)
        exact += torch.equal(final[name], reference)
        worst = max(worst, (final[name] - reference).abs().max().item())
    same_scale = same_zp = same_buffers = 0
    for name in names:
        q, fq = handle.activations[name], wrapped[name].fake_quant
        scale, zero_point = fq.calculate_qparams()
        same_scale += torch.equal(q.scale.reshape(1), scale)
        same_zp += torch.equal(q.zero_point.reshape(1).to(zero_point.dtype), zero_point)
        same_buffers += torch.equal(fq.scale, scale) and torch.equal(fq.zero_point, zero_point)
    with torch.no_grad():
        outs = {name: models[name](example) for name in (PLAIN, TORCH_OFF, W8A8, W8_BAKED, WHAT_IF) if name in models}
    lines = [
        f"surgery A8 layer outputs == torch.fake_quantize_per_tensor_affine(raw output, our scale, our "
        f"zero point, {quant_min}, {quant_max}): {exact}/{len(names)} layers bit-exact, max |diff| {worst:.3g}",
        f"qparams, surgery vs FakeQuantize observer calculate_qparams(): scale equal in {same_scale}/{len(names)}, "
        f"zero point equal in {same_zp}/{len(names)} layers (FakeQuantize buffers hold them: "
        f"{same_buffers}/{len(names)})",
        f"model outputs on a fresh input: max |surgery A8 - torch FakeQuantize| = "
        f"{(ours_out - outs[TORCH_OFF]).abs().max().item():.3g}; max |plain - surgery A8| = "
        f"{(outs[PLAIN] - ours_out).abs().max().item():.3g}; max |plain - surgery W8 baked| = "
        f"{(outs[PLAIN] - outs[W8_BAKED]).abs().max().item():.3g}; max |plain - surgery W8A8| = "
        f"{(outs[PLAIN] - outs[W8A8]).abs().max().item():.3g}",
    ]
    if WHAT_IF in outs:
        layers = sum(torch.equal(ArithmeticHook(handle.activations[n]).apply(raw[n]), final[n]) for n in names)
        lines.append(
            f"what-if arithmetic path == fused op: {layers}/{len(names)} layers bit-exact on the same raw "
            f"outputs; model output max |diff| {(outs[WHAT_IF] - ours_out).abs().max().item():.3g}"
        )
    return lines, raw


# --- where the activation overhead goes (direct calls, best of several: robust to load) ----------


def best(fn: Callable[[], object], repeats: int) -> float:
    return min(timed(fn)[0] for _ in range(repeats))


def hook_dispatch_cost(repeats: int = 2000) -> float:
    """Extra seconds a module call costs once it has a forward hook (the slow call path)."""
    module, example = nn.Identity(), torch.zeros(1)
    bare = best(lambda: [module(example) for _ in range(repeats)], 5) / repeats
    hook = module.register_forward_hook(lambda mod, args, out: None)
    hooked = best(lambda: [module(example) for _ in range(repeats)], 5) / repeats
    hook.remove()
    return max(hooked - bare, 0.0)


def overhead_costs(
    handle: surgery.QuantizeHandle,
    wrapped: dict[str, FakeQuantized],
    raw: dict[str, Tensor],
    plain_best_s: float,
    repeats: int = 5,
) -> list[str]:
    """The fused kernel on the real layer outputs vs the arithmetic path, and the Python cost per call."""
    names = list(handle.activations)
    quant_min, quant_max = A8.quant_range
    quantizers = [handle.activations[n] for n in names]
    with torch.no_grad():
        kernel = sum(
            best(
                lambda x=raw[n], q=q: torch.fake_quantize_per_tensor_affine(
                    x, q.scale, q.zero_point, quant_min, quant_max
                ),
                repeats,
            )
            for n, q in zip(names, quantizers)
        )
        floats = [ArithmeticHook(q) for q in quantizers]
        kernel_f = sum(
            best(
                lambda x=raw[n], h=h: torch.fake_quantize_per_tensor_affine(
                    x, h.scale, h.zero_point, quant_min, quant_max
                ),
                repeats,
            )
            for n, h in zip(names, floats)
        )
        arith = sum(best(lambda x=raw[n], h=h: h.apply(x), repeats) for n, h in zip(names, floats))
        tiny, calls = torch.zeros(1), 200
        bare = best(
            lambda: [
                torch.fake_quantize_per_tensor_affine(tiny, q.scale, q.zero_point, quant_min, quant_max)
                for q in quantizers
                for _ in range(calls // len(quantizers) + 1)
            ],
            repeats,
        )
        ours = best(
            lambda: [q(None, (), tiny) for q in quantizers for _ in range(calls // len(quantizers) + 1)], repeats
        )
        fqs = [wrapped[n].fake_quant for n in names]
        torch_fq = best(lambda: [fq(tiny) for fq in fqs for _ in range(calls // len(fqs) + 1)], repeats)
    per = len(quantizers) * (calls // len(quantizers) + 1)
    python_us = (ours - bare) / per * 1e6
    torch_us = (torch_fq - bare) / per * 1e6
    dispatch_us = hook_dispatch_cost() * 1e6
    per_forward = len(names) * (python_us + dispatch_us) / 1e6

    def pct(seconds: float) -> str:
        return f"{seconds * 1e3:.1f} ms = {seconds / plain_best_s * 100:.1f}% of plain's fastest forward"

    n = len(names)
    return [
        f"fused torch.fake_quantize_per_tensor_affine on the {n} real layer outputs (tensor qparams, as surgery "
        f"and FakeQuantize call it): {pct(kernel)}; with float qparams: {pct(kernel_f)}",
        f"same results by mul/round_/clamp_/mul_ (what-if, no mask, no autograd rule): {pct(arith)}",
        f"Python path per call on a 1-element tensor, beyond the bare op: surgery hook {python_us:.1f} us, "
        f"FakeQuantize (obs. off) {torch_us:.1f} us; forward-hook dispatch {dispatch_us:.1f} us; "
        f"surgery: {n} x ({python_us:.1f} + {dispatch_us:.1f}) us = {per_forward * 1e3:.2f} ms per forward "
        f"= {per_forward / plain_best_s * 100:.2f}% of plain's fastest forward",
    ]


# --- accuracy on the offline digits data -------------------------------------------------------


def digits_accuracy() -> tuple[dict[str, float], str]:
    """Test accuracy of the shipped digits CNN, float and quantized; ({}, reason) when unavailable."""
    try:
        from surgery.analysis import metrics
        from surgery.core.checkpoints import load_checkpoint
        from surgery.tasks import digits

        needed = [digits.DigitsCNN, digits.CHECKPOINT, digits.digits_batches, metrics.accuracy]
    except (ImportError, AttributeError) as err:
        return {}, f"surgery.tasks.digits is not usable yet ({type(err).__name__}: {err})"
    model_class, checkpoint, make_batches, accuracy = needed
    if not Path(checkpoint).is_file():
        return {}, f"no digits checkpoint at {checkpoint}"
    try:
        test = make_batches("test", 256)
        calibration = [images for images, _ in make_batches("train", 64, limit_batches=8)]
    except surgery.ConfigError as err:  # e.g. scikit-learn missing
        return {}, f"digits data unavailable: {err}"
    w4 = surgery.GridSpec(bits=4, symmetric=True, per_channel=True)
    setups = {
        "float": None,
        "W8 (int8 sym. per-channel)": {},
        "A8 (uint8 affine per-tensor)": {"weights": None, "activations": A8},
        "W8A8": {"activations": A8},
        "W4 (int4 sym. per-channel)": {"weights": w4},
        "W4A8": {"weights": w4, "activations": A8},
    }
    scores = {}
    for name, kwargs in setups.items():
        model = load_checkpoint(model_class(), checkpoint).eval()
        if kwargs is not None:
            if "activations" in kwargs:
                kwargs = {**kwargs, "calibration": calibration}
            surgery.quantize(model, progress=False, **kwargs)
        scores[name] = accuracy(model, test)
    count = sum(len(labels) for _, labels in test)
    return scores, (
        f"{count} test images (one image = {100 / count:.2f} points); activations calibrated on "
        f"{sum(len(b) for b in calibration)} train images"
    )


# --- run, then print -----------------------------------------------------------------------------


def run(args: argparse.Namespace, rng: np.random.Generator) -> Result:
    torch.manual_seed(0)
    base = torchvision.models.resnet50(weights=None).eval()
    calibration = [torch.randn(1, 3, 224, 224) for _ in range(args.calibration)]
    example = torch.randn(1, 3, 224, 224)
    models, results, handle, wrapped = build_variants(base, calibration, args.copies, not args.no_what_if)
    firsts = {name: copies[0] for name, copies in models.items()}
    checks, raw = sanity_checks(firsts, handle, wrapped, example)
    inner = calls_per_sample(firsts[PLAIN], example)
    spec = TimingSpec(
        "resnet50",
        args.repeats or (25 if args.quick else 150),
        2 if args.quick else 4,
        args.max_seconds
        if args.max_seconds is not None
        else (float("inf") if args.repeats else (40.0 if args.quick else 170.0)),
    )
    start = time.perf_counter()
    samples = round_robin(models, example, spec, inner, rng)
    seconds = time.perf_counter() - start
    for name, times in samples.items():
        results[name].latency = latency(times, samples[PLAIN], rng)
    costs = overhead_costs(handle, wrapped, raw, float(samples[PLAIN].min()))
    return Result("resnet50", inner, args.copies, len(samples[PLAIN]), seconds, checks, costs, results)


def print_result(result: Result) -> None:
    print(
        f"\n== {result.model}, batch 1, 224x224, int8 activations on every Conv2d/Linear output: "
        f"{result.rounds} rounds x {result.calls_per_sample} call(s) per sample, {result.copies} copies per "
        f"variant, timed for {result.timing_s:.0f} s =="
    )
    for line in result.checks:
        print(f"  check: {line}")
    header = (
        f"  {'variant':<30}{'median ms':>10}{'p25-p75 ms':>17}{'ratio [95% CI]':>22}{'target':>12}{'':>6}"
        f"{'apply s':>14}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for name, v in result.variants.items():
        lat, target = v.latency, TARGETS.get(name)
        print(
            f"  {name:<30}{lat.median_ms:>10.1f}{f'{lat.p25_ms:.1f}-{lat.p75_ms:.1f}':>17}"
            f"{f'{lat.ratio:.3f} [{lat.ratio_low:.3f},{lat.ratio_high:.3f}]':>22}"
            f"{target.text() if target else '':>12}"
            f"{target.verdict(lat.ratio, lat.ratio_low, lat.ratio_high) if target else '':>6}{fmt_apply(v.apply_s, 2):>14}"
        )
    print("  where surgery's A8 overhead goes (direct calls, best of 5, summed over layers):")
    for line in result.costs:
        print(f"    {line}")
    print("\n== digits CNN, test accuracy ==")
    if not result.digits:
        print(f"  skipped: {result.digits_note}")
        return
    print(f"  {result.digits_note}")
    reference = result.digits["float"]
    for name, value in result.digits.items():
        drop = (reference - value) * 100
        verdict = ""
        if name == "W8A8":
            verdict = f"   target drop <= {DIGITS_MAX_DROP:.1f}  {'ok' if drop <= DIGITS_MAX_DROP else 'MISS'}"
        print(f"  {name:<30}{value * 100:>7.2f}%   drop {drop:+.2f} points{verdict}")


def print_legend() -> None:
    print(
        "\nlegend: ratio = median over rounds of (variant / plain in the same round), CI = bootstrap 95% of that "
        "median; ok/MISS = the whole CI meets/misses the target, ok?/MISS? = only the point does; 1.00x means "
        "within 1%. A8 = uint8 [0, 255] affine per-tensor, min/max calibrated on the same random batches for "
        "both methods (FakeQuantize with MinMaxObserver, fake-quant off while calibrating, as surgery). "
        "'obs. on' keeps observing every forward (QAT-style); 'ref 1.76x' is the figure quoted to us for "
        "FakeQuantize on resnet50 batch 1, its settings unstated. W8 = int8 symmetric per-channel weights "
        "(surgery's default). apply s = first copy / median of the others, calibration included (for "
        "FakeQuantize: wrapping + calibration by this script). The what-if row is not surgery: the same "
        "hook with the fused op replaced by 4 vectorized passes, to size a fix. eval(), no_grad."
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (about 1.5 minutes)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timing rounds (default 150, 25 with --quick); given explicitly, no time cap "
        "applies unless --max-seconds is given too",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop timing after this many seconds (default 170, 40 with --quick)",
    )
    add_shared_arguments(parser)
    parser.add_argument("--calibration", type=int, default=4, help="random calibration batches (default 4)")
    parser.add_argument("--no-what-if", action="store_true", help="leave out the what-if row")
    parser.add_argument("--no-digits", action="store_true", help="skip the digits accuracy")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 5:
        parser.error("--repeats must be at least 5")
    if args.copies is None:
        args.copies = 2 if args.quick else 3
    if args.copies < 1 or args.calibration < 1:
        parser.error("--copies and --calibration must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_threads(args.threads)
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    result = run(args, rng)
    if args.no_digits:
        result.digits_note = "--no-digits"
    else:
        result.digits, result.digits_note = digits_accuracy()
    print_result(result)
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
            json.dump({"threads": args.threads, "total_s": total, "result": asdict(result)}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
