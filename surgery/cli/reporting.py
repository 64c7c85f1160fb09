"""Run reports: ``report.json``, ``report.md``, the per-layer sparsity plot, a summary table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.analysis.attribution import AttributionDrift
from surgery.cli.checks import CheckResult
from surgery.core.checkpoints import write_atomically


def layer_rows(model: nn.Module, sparsity: dict[str, float], drift: list | None = None) -> list[dict[str, Any]]:
    """One row per module owning parameters: name, type, sparsity (masked weights only) and,
    with per-layer drift, its cosine, SQNR and max abs error against the reference."""
    by_name = {layer.name: layer for layer in drift or []}
    rows = []
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        key = f"{name}.weight" if name else "weight"
        layer = by_name.get(name)
        rows.append(
            {
                "name": name,
                "type": type(module).__name__,
                "sparsity": sparsity.get(key),
                "cosine": None if layer is None else layer.cosine,
                "sqnr_db": None if layer is None else layer.sqnr_db,
                "max_abs": None if layer is None else layer.max_abs,
            }
        )
    return rows


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total and non-zero parameter entries (each shared parameter counted once)."""
    params = list(model.parameters())
    return {"total": sum(p.numel() for p in params), "nonzero": sum(int(p.count_nonzero()) for p in params)}


def checks_rows(checks: list[CheckResult]) -> list[dict[str, Any]]:
    return [
        {"name": c.name, "passed": c.passed, "value": c.value, "threshold": c.threshold, "detail": c.detail}
        for c in checks
    ]


def finite(value: Any) -> Any:
    """Replace non-finite floats (not valid JSON) by ``None``, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def write_reports(report: dict[str, Any], out_dir: Path, *, plots: bool) -> list[Path]:
    """Write ``report.json``, ``report.md`` and (if ``plots``) ``sparsity.png`` atomically."""
    written = [out_dir / "report.json", out_dir / "report.md"]
    text = json.dumps(finite(report), indent=2, allow_nan=False)
    write_atomically(written[0], lambda tmp: tmp.write_text(text + "\n"))
    markdown = render_markdown(report)
    write_atomically(written[1], lambda tmp: tmp.write_text(markdown))
    if plots and any(row["sparsity"] is not None for row in report["layers"]):
        written.append(out_dir / "sparsity.png")
        write_atomically(written[-1], lambda tmp: plot_sparsity(report, tmp))
    if plots and any(row.get("cosine") is not None for row in report["layers"]):
        written.append(out_dir / "drift.png")
        write_atomically(written[-1], lambda tmp: plot_layer_drift(report, tmp))
    if plots and any(row["share"] is not None for row in report.get("gradients", {}).get("layers", [])):
        written.append(out_dir / "gradients.png")
        write_atomically(written[-1], lambda tmp: plot_gradients(report, tmp))
    if plots and any(point["score"] is not None for point in report.get("finetune", {}).get("curve", [])):
        written.append(out_dir / "finetune.png")
        write_atomically(written[-1], lambda tmp: plot_finetune(report, tmp))
    if plots and report.get("shrink", {}).get("widths"):
        written.append(out_dir / "widths.png")
        write_atomically(written[-1], lambda tmp: plot_widths(report, tmp))
    if plots and report.get("sensitivity", {}).get("rows"):
        written.append(out_dir / "sensitivity.png")
        write_atomically(written[-1], lambda tmp: plot_sensitivity(report, tmp))
    return written


def plot_gradients(report: dict[str, Any], path: Path) -> None:
    """Each layer's share of the loss sensitivity (Σ|w·∂L/∂w|) and its gradient norm, in model order."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = [row for row in report["gradients"]["layers"] if row["share"] is not None]
    height = max(3.0, 0.16 * len(rows) + 1.2)
    fig, (share, norm) = plt.subplots(1, 2, figsize=(11, height), sharey=True)
    positions = range(len(rows))
    share.barh(positions, [row["share"] for row in rows], color="#4C72B0")
    share.set_yticks(positions, [row["name"] for row in rows], fontsize=6 if len(rows) > 30 else 8)
    share.invert_yaxis()
    share.set_xlabel("share of loss sensitivity Σ|w·∂L/∂w|")
    norm.barh(positions, [row["weight_grad_norm"] or 0.0 for row in rows], color="#DD8452")
    norm.set_xscale("log")
    norm.set_xlabel("‖∂L/∂w‖ (RMS over batches)")
    fig.suptitle(f"{report['recipe']}: gradients of {report['model']} ({report['gradients']['loss']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def plot_widths(report: dict[str, Any], path: Path) -> None:
    """Each shrunk layer's output width before and after, in model order."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    widths = report["shrink"]["widths"]
    names = list(widths)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.12 * len(names) + 2), 4.5))
    ax.bar(range(len(names)), [w[0] for w in widths.values()], color="#C8C8C8", label="before")
    ax.bar(range(len(names)), [w[1] for w in widths.values()], color="#4C72B0", label="after")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=5)
    ax.set_ylabel("output channels / features")
    ax.legend()
    ax.set_title(f"{report['recipe']}: {report['model']} layer widths")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def sensitivity_markdown(report: dict[str, Any]) -> list[str]:
    """The sensitivity table (score per layer and amount) and the amounts for a target, as markdown lines."""
    result = report["sensitivity"]
    layers, amounts, grid = sensitivity_grid(report)
    lines = [
        f"## Sensitivity ({result['metric']}; {'higher' if result['higher_is_better'] else 'lower'} is better; "
        f"unchanged {result['baseline']:.4g})",
        "",
        f"Each layer {'quantized' if result.get('kind') == 'quantize' else 'pruned'} alone by {result['method']}.",
        "",
        "| layer | " + " | ".join(f"{a:g}" for a in amounts) + " |",
        "| --- |" + " --- |" * len(amounts),
    ]
    lines += [f"| {layer} | " + " | ".join(_fmt(v) for v in row) + " |" for layer, row in zip(layers, grid)]
    if "plan" in result:
        plan = result["plan"]
        lines += [
            "",
            f"Amounts reaching {plan['target_sparsity']:g} sparsity over these layers (amounts.yaml, for `prune.amounts`):",
            "",
            "| layer | amount |",
            "| --- | --- |",
        ]
        lines += [f"| {layer} | {amount:.4g} |" for layer, amount in plan["amounts"].items()]
    return lines


def sensitivity_grid(report: dict[str, Any]) -> tuple[list[str], list[float], list[list[float | None]]]:
    """(layers, amounts, score per layer and amount) of a sensitivity report."""
    rows = report["sensitivity"]["rows"]
    layers = list(dict.fromkeys(row["layer"] for row in rows))
    amounts = sorted({row["setting"] for row in rows}, reverse=report["sensitivity"].get("kind") == "quantize")
    found = {(row["layer"], row["setting"]): row["score"] for row in rows}
    return layers, amounts, [[found.get((layer, amount)) for amount in amounts] for layer in layers]


def plot_sensitivity(report: dict[str, Any], path: Path) -> None:
    """Heatmap of the damage (score worse than unpruned) of each layer pruned alone at each amount."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    result = report["sensitivity"]
    layers, amounts, _ = sensitivity_grid(report)
    damage = {(row["layer"], row["setting"]): row["damage"] for row in result["rows"]}
    grid = [[damage.get((layer, amount), float("nan")) for amount in amounts] for layer in layers]
    fig, ax = plt.subplots(figsize=(1.4 * len(amounts) + 3.5, 0.35 * len(layers) + 1.8))
    image = ax.imshow(grid, aspect="auto", cmap="magma_r")
    ax.set_xticks(range(len(amounts)), [f"{a:g}" for a in amounts])
    ax.set_yticks(range(len(layers)), layers)
    ax.set_xlabel(
        "weight bits (this layer alone)" if result.get("kind") == "quantize" else "amount pruned (this layer alone)"
    )
    top = max((v for row in grid for v in row if v == v), default=0.0)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(
                j,
                i,
                f"{value:.3g}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if value > 0.6 * top else "black",
            )
    fig.colorbar(
        image, ax=ax, label=f"damage ({result['metric']} {'lost' if result['higher_is_better'] else 'gained'})"
    )
    ax.set_title(f"{report['recipe']}: which layers of {report['model']} hurt most ({result['method']})")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def plot_finetune(report: dict[str, Any], path: Path) -> None:
    """Accuracy (and training loss) against optimizer steps while fine-tuning, with the
    unmodified model's accuracy as a reference line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    curve = report["finetune"]["curve"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(
        [p["step"] for p in curve],
        [p["score"] for p in curve],
        marker="o",
        color="#4C72B0",
        label="accuracy (modified, fine-tuning)",
    )
    if "accuracy" in report:
        ax.axhline(report["accuracy"]["reference"], color="#55A868", linestyle="--", label="accuracy (unmodified)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("top-1 accuracy")
    ax.grid(alpha=0.3)
    losses = [(p["step"], p["loss"]) for p in curve if p["loss"] is not None]
    if losses:
        twin = ax.twinx()
        twin.plot(*zip(*losses), color="#DD8452", alpha=0.6, label="training loss")
        twin.set_ylabel("training loss")
        twin.legend(loc="center right")
    ax.legend(loc="lower right")
    ax.set_title(
        f"{report['recipe']}: fine-tuning {report['model']} with {', '.join(report['steps'][:-1]) or 'it'} attached"
    )
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def plot_layer_drift(report: dict[str, Any], path: Path) -> None:
    """Per-layer drift by depth (cosine and SQNR), with per-layer sparsity when pruned."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = [row for row in report["layers"] if row.get("cosine") is not None]
    depth = list(range(len(rows)))
    pruned = any(row["sparsity"] is not None for row in rows)
    fig, axes = plt.subplots(3 if pruned else 2, 1, figsize=(9, 7 if pruned else 5), sharex=True)
    axes[0].plot(depth, [row["cosine"] for row in rows], marker=".", color="#4C72B0")
    axes[0].set_ylabel("cosine vs reference")
    sqnr = [row["sqnr_db"] if row["sqnr_db"] is not None else float("nan") for row in rows]
    axes[1].plot(depth, sqnr, marker=".", color="#DD8452")
    axes[1].set_ylabel("SQNR dB")
    if pruned:
        axes[2].bar(depth, [row["sparsity"] or 0.0 for row in rows], color="#55A868")
        axes[2].set_ylabel("sparsity")
        axes[2].set_ylim(0, 1)
    axes[-1].set_xlabel("layer (model order)")
    step = max(1, len(rows) // 20)
    axes[-1].set_xticks(depth[::step], [row["name"] for row in rows][::step], rotation=60, ha="right", fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{report['recipe']}: per-layer drift of {report['model']}")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def plot_sparsity(report: dict[str, Any], path: Path) -> None:
    """Horizontal bar chart of per-layer sparsity, in model order."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = [row for row in report["layers"] if row["sparsity"] is not None]
    height = max(3.0, 0.16 * len(rows) + 1.2)
    fig, ax = plt.subplots(figsize=(8, height))
    ax.barh(range(len(rows)), [row["sparsity"] for row in rows], color="#4C72B0")
    ax.set_yticks(range(len(rows)), [row["name"] for row in rows], fontsize=6 if len(rows) > 30 else 8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.axvline(report["sparsity"], color="#C44E52", linestyle="--", label=f"overall {report['sparsity']:.3f}")
    ax.set_xlabel("fraction of weights pruned")
    ax.set_title(f"{report['recipe']}: per-layer sparsity of {report['model']}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _over(over: dict[str, int] | None) -> str:
    return f" ({over['parameters']} weights, {over['entries']:,} entries)" if over and over["parameters"] else ""


def render_markdown(report: dict[str, Any]) -> str:
    """The human-readable report: outcome, checks, drift, timings and per-layer table."""
    lines: list[str] = []
    for section in MARKDOWN_SECTIONS:
        lines += section(report)
    return "\n".join(lines) + "\n"


def _markdown_header(report: dict[str, Any]) -> list[str]:
    """Outcome, parameters and the checks."""
    lines: list[str] = []
    lines += [
        f"# surgery report: {report['recipe']}",
        "",
        f"Model `{report['model']}` — **{'all checks passed' if report['ok'] else 'a check FAILED'}**.",
        "",
        f"Parameters: {report['params']['total']:,} total, {report['params']['nonzero']:,} non-zero; "
        f"sparsity over selected weights: {report['sparsity']:.4f}"
        f"{_over(report.get('sparsity_over'))}.",
        "",
        "## Checks",
        "",
        "| check | passed | value | threshold | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {c['name']} | {_fmt(c['passed'])} | {_fmt(c['value'])} | {_fmt(c['threshold'])} | {c['detail']} |"
        for c in report["checks"]
    ]
    return lines


def _markdown_accuracy(report: dict[str, Any]) -> list[str]:
    """Accuracy on labelled data (before and after fine-tuning when there was some)."""
    lines: list[str] = []
    if "accuracy" in report:
        acc = report["accuracy"]
        if "before_finetune" in acc:
            lines += [
                "",
                "## Accuracy (labelled data)",
                "",
                "| unmodified | after surgery, before fine-tuning | after fine-tuning | drop (points) |",
                "| --- | --- | --- | --- |",
                f"| {acc['reference']:.4f} | {acc['before_finetune']:.4f} | "
                f"{acc['candidate']:.4f} | {acc['drop_points']:.2f} |",
            ]
        else:
            lines += [
                "",
                "## Accuracy (labelled data)",
                "",
                "| reference | candidate | drop (points) |",
                "| --- | --- | --- |",
                f"| {acc['reference']:.4f} | {acc['candidate']:.4f} | {acc['drop_points']:.2f} |",
            ]
    return lines


def _markdown_sensitivity(report: dict[str, Any]) -> list[str]:
    return ["", *sensitivity_markdown(report)] if "sensitivity" in report else []


def _markdown_shrink(report: dict[str, Any]) -> list[str]:
    """Parameters, MACs, latency, families and heads of a shrink step."""
    lines: list[str] = []
    if "shrink" in report:
        shrunk = report["shrink"]
        lines += ["", "## Shrink", "", "| | before | after | ratio |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {key} | {shrunk[key]['before']:,} | {shrunk[key]['after']:,} | "
            f"{shrunk[key]['after'] / max(shrunk[key]['before'], 1):.3f} |"
            for key in ("params", "macs")
        ]
        lines += [
            f"| latency, batch {size} (ms, 1 thread) | {row['dense_ms']:.1f} | {row['shrunk_ms']:.1f} | "
            f"{row['ratio']:.3f} |"
            for size, row in shrunk["latency"].items()
        ]
        lines += [
            "",
            "Coupled families (layers producing the same channels):",
            "",
            "| layers | channels | removed | frozen |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| {', '.join(f['layers'][:4])}{' ...' if len(f['layers']) > 4 else ''} | {f['channels']} | "
            f"{f['removed']} | {f['frozen']} |"
            for f in shrunk["families"]
        ]
        if shrunk.get("heads"):
            lines += [
                "",
                "Attention heads:",
                "",
                "| module | attribute | before | after |",
                "| --- | --- | --- | --- |",
            ]
            lines += [
                f"| {name} | {attr} | {old} | {new} |"
                for name, changes in shrunk["heads"].items()
                for attr, (old, new) in changes.items()
            ]
        if shrunk.get("frozen_ops"):
            lines += ["", f"Channels kept by: {', '.join(shrunk['frozen_ops'])}."]
    return lines


def _markdown_quantize(report: dict[str, Any]) -> list[str]:
    """What the quantized model stores, against fp32."""
    if "quantize" not in report:
        return []
    stored = report["quantize"]
    return [
        "",
        "## Quantization",
        "",
        "| weights | share of the parameters | bits per weight | bytes | x fp32 |",
        "| --- | --- | --- | --- | --- |",
        f"| {stored['weights']} | {stored['share_of_parameters']:.1%} | {stored['bits_per_weight']:.3f} "
        f"| {stored['bytes']:,} | {stored['bytes_vs_fp32']:.3f} |",
        "",
        "Bits per weight count the values and their scales (half precision; the MX/NV formats' block "
        "scales at 8 bits) and zero points; parameters left float count at their own dtype.",
    ]


def _markdown_perplexity(report: dict[str, Any]) -> list[str]:
    """Held-out perplexity of a language model."""
    lines: list[str] = []
    if "perplexity" in report:
        ppl = report["perplexity"]
        lines += [
            "",
            "## Perplexity (held-out bytes)",
            "",
            "| reference | candidate |",
            "| --- | --- |",
            f"| {ppl['reference']:.3f} | {ppl['candidate']:.3f} |",
        ]
    return lines


def _markdown_finetune(report: dict[str, Any]) -> list[str]:
    """The fine-tuning curve."""
    lines: list[str] = []
    if "finetune" in report:
        tuned = report["finetune"]
        lines += [
            "",
            "## Fine-tuning",
            "",
            f"{tuned['steps']} steps of {tuned['optimizer']} (lr {tuned['lr']}, "
            f"{tuned['epochs']} epochs, batch {tuned['batch_size']}), the earlier steps attached.",
            "",
            "| step | mean training loss | accuracy |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {p['step']} | {_fmt(p['loss'])} | {_fmt(p['score'])} |" for p in tuned["curve"]]
    return lines


def _markdown_drift(report: dict[str, Any]) -> list[str]:
    """Drift, timings and the per-layer table."""
    lines: list[str] = []
    drift = report["drift"]
    sqnr = "∞ (identical)" if drift["sqnr_db"] is None and drift["max_abs"] == 0 else _fmt(drift["sqnr_db"])
    lines += [
        "",
        "## Drift (original vs modified)",
        "",
        "| max abs | cosine | SQNR dB | top-1 agreement |",
        "| --- | --- | --- | --- |",
        f"| {_fmt(drift['max_abs'])} | {_fmt(drift['cosine'])} | {sqnr} | {_fmt(drift['top1_agreement'])} |",
        "",
        "## Timings (s)",
        "",
        "| build | surgery | checks |",
        "| --- | --- | --- |",
        "| " + " | ".join(f"{report['timings_s'][k]:.2f}" for k in ("build", "surgery", "checks")) + " |",
        "",
        "## Layers",
        "",
        "| layer | type | sparsity | cosine | SQNR dB | max abs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| `{row['name']}` | {row['type']} | {_fmt(row['sparsity'])} | {_fmt(row.get('cosine'))} | "
        f"{_fmt(row.get('sqnr_db'))} | {_fmt(row.get('max_abs'))} |"
        for row in report["layers"]
    ]
    return lines


def _markdown_selection_and_inspection(report: dict[str, Any]) -> list[str]:
    """What each step selected and skipped; module calls and gradients."""
    lines: list[str] = []
    for kind, selection in report.get("selection", {}).items():
        lines += ["", f"## Selection: {kind}", "", f"{len(selection['matched'])} weight(s) matched.", ""]
        if selection["skipped"]:
            lines += ["| skipped | type | why |", "| --- | --- | --- |"]
            lines += [f"| `{s['name']}` | {s['type']} | {s['reason']} |" for s in selection["skipped"]]
    if report.get("modules"):
        lines += ["", "## Module calls (inspect)", "", "```", report.get("modules_table", ""), "```"]
    if report.get("gradients"):
        grads = report["gradients"]
        top = sorted((r for r in grads["layers"] if r["share"] is not None), key=lambda r: -r["share"])[:15]
        lines += [
            "",
            "## Gradients (inspect)",
            "",
            f"Loss: {grads['loss']}; measured with {grads['mechanism']}. "
            "The 15 layers with the largest share of the loss sensitivity:",
            "",
            r"| layer | type | share | Σ\|w·∂L/∂w\| | ‖∂L/∂w‖ | ‖∂L/∂output‖ |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| `{r['name']}` | {r['type']} | {_fmt(r['share'])} | {_fmt(r['sensitivity'])} | "
            f"{_fmt(r['weight_grad_norm'])} | {_fmt(r['grad_output_norm'])} |"
            for r in top
        ]
    return lines


def _markdown_offloaded(report: dict[str, Any]) -> list[str]:
    """Memory and seconds per block of a run on an offloaded model."""
    lines = offloaded_lines(report)
    return ["", "## Offloaded", "", *[f"- {line.strip()}" for line in lines]] if lines else []


MARKDOWN_SECTIONS = (
    _markdown_header,
    _markdown_offloaded,
    _markdown_accuracy,
    _markdown_sensitivity,
    _markdown_shrink,
    _markdown_quantize,
    _markdown_perplexity,
    _markdown_finetune,
    _markdown_drift,
    _markdown_selection_and_inspection,
)


def selection_lines(report: dict[str, Any]) -> list[str]:
    """One line per step: how many weights it matched, and what it skipped."""
    lines = []
    for kind, selection in report.get("selection", {}).items():
        skipped = selection["skipped"]
        names = ", ".join(f"{s['name']} ({s['type']})" for s in skipped[:4]) + (" ..." if len(skipped) > 4 else "")
        lines.append(
            f"{kind}: {len(selection['matched'])} weight(s) matched, {len(skipped)} skipped"
            f"{': ' + names if skipped else ''}"
        )
    return lines


def _bytes(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def offloaded_lines(report: dict[str, Any]) -> list[str]:
    """Memory and time of a run on an offloaded model (``model.offload=true``)."""
    if "offloaded" not in report:
        return []
    found = report["offloaded"]
    lines = [
        f"  offloaded: peak memory {_bytes(found['peak_memory_bytes'])}, of which the run added "
        f"{_bytes(found['added_memory_bytes'])} ({found['added_over_model']:.2f}x the model's "
        f"{_bytes(found['model_bytes'])})"
    ]
    for step, row in found["steps"].items():
        per_block = "n/a" if row["seconds_per_block"] is None else f"{row['seconds_per_block']:.2f} s"
        resumed = f", {row['resumed']} resumed from {row['work']}" if row["resumed"] else ""
        spilled = f", {_bytes(row['spilled_bytes'])} of activations spilled to disk" if row.get("spilled_bytes") else ""
        lines.append(f"  {step}: {row['blocks']} blocks, {per_block} per block{resumed}{spilled}")
    return lines


def summary_table(report: dict[str, Any]) -> str:
    """A short plain-text table for the terminal."""
    drift = report["drift"]
    width = max(len(c["name"]) for c in report["checks"]) if report["checks"] else 8
    pruned = (report.get("sparsity_over") or {}).get("parameters", 0) > 0
    headline = f"recipe {report['recipe']}  model {report['model']}"
    if pruned:
        headline += f"  sparsity {report['sparsity']:.4f}"
    lines = [headline + f"  params {report['params']['nonzero']:,}/{report['params']['total']:,} non-zero"]
    if "quantize" in report:
        stored = report["quantize"]
        lines.append(
            f"  quantize: {stored['bits_per_weight']:.3g} bits per weight over {stored['weights']} weights "
            f"({stored['share_of_parameters']:.0%} of the parameters); the model {stored['bytes'] / 1e6:.3g} MB, "
            f"{stored['bytes_vs_fp32']:.3f}x its fp32 bytes"
        )
    lines += [f"  {line}" for line in selection_lines(report)]
    for c in report["checks"]:
        value = "" if c["value"] is None else f"{c['value']:.4g}"
        lines.append(f"  {c['name']:<{width}}  {'PASS' if c['passed'] else 'FAIL'}  {value:>10}  {c['detail']}")
    sqnr = "inf" if drift["sqnr_db"] is None else f"{drift['sqnr_db']:.2f}"
    top1 = "n/a" if drift["top1_agreement"] is None else f"{drift['top1_agreement']:.3f}"
    lines.append(f"  drift: cosine {drift['cosine']:.4f}  SQNR {sqnr} dB  max abs {drift['max_abs']:.4g}  top-1 {top1}")
    if "accuracy" in report:
        acc = report["accuracy"]
        if "before_finetune" in acc:
            lines.append(
                f"  accuracy: unmodified {acc['reference']:.4f}  after surgery {acc['before_finetune']:.4f}  "
                f"after fine-tuning {acc['candidate']:.4f}  drop {acc['drop_points']:.2f} points"
            )
        else:
            lines.append(
                f"  accuracy: reference {acc['reference']:.4f}  candidate {acc['candidate']:.4f}  "
                f"drop {acc['drop_points']:.2f} points"
            )
    if "sensitivity" in report:
        result = report["sensitivity"]
        layers, amounts, grid = sensitivity_grid(report)
        lines.append(
            f"  sensitivity ({result['metric']}, unchanged {result['baseline']:.4g}), layer x "
            f"{'weight bits' if result.get('kind') == 'quantize' else 'amount'}:"
        )
        lines.append("    " + " " * 24 + "".join(f"{a:>9g}" for a in amounts))
        lines += ["    " + f"{layer[:24]:<24}" + "".join(f"{v:>9.4g}" for v in row) for layer, row in zip(layers, grid)]
        if "plan" in result:
            lines.append(
                f"  amounts for {result['plan']['target_sparsity']:g} sparsity: "
                + ", ".join(f"{k} {v:.3g}" for k, v in result["plan"]["amounts"].items())
            )
    if "shrink" in report:
        shrunk = report["shrink"]
        params, macs = shrunk["params"], shrunk["macs"]
        lines.append(
            f"  shrink: params {params['before']:,} -> {params['after']:,} "
            f"({params['after'] / params['before']:.3f}x), MACs {macs['before']:,} -> {macs['after']:,} "
            f"({macs['after'] / max(macs['before'], 1):.3f}x)"
        )
        lines += [
            f"  latency batch {size}: dense {row['dense_ms']:.1f} ms, shrunk {row['shrunk_ms']:.1f} ms "
            f"({row['ratio']:.3f}x, 1 thread)"
            for size, row in shrunk["latency"].items()
        ]
    if "perplexity" in report:
        ppl = report["perplexity"]
        lines.append(f"  perplexity (held out): reference {ppl['reference']:.3f}  candidate {ppl['candidate']:.3f}")
    lines += offloaded_lines(report)
    lines.append(f"  result: {'OK' if report['ok'] else 'CHECK FAILED'}")
    return "\n".join(lines)


def plot_attribution(found: AttributionDrift, path: Path) -> None:
    """The overlay grid: per input, the input, the reference's map, the modified model's map
    and their difference (images); for token maps, heat strips of the three per input."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    reference, candidate = found.reference_maps.float(), found.candidate_maps.float()
    rows = reference.shape[0]
    spatial = reference.dim() == 3
    columns = 4 if spatial else 1
    fig, axes = plt.subplots(
        rows, columns, figsize=(2.2 * columns + (6 if not spatial else 0), 1.9 * rows), squeeze=False
    )
    for row in range(rows):
        cosine, overlap = found.cosine[row], found.overlap[row]
        label = f"cos {cosine:.2f}, top-{found.top_k:.0%} overlap {overlap:.2f}"
        if spatial:
            _image_row(
                axes[row], found.inputs[row] if found.inputs is not None else None, reference[row], candidate[row]
            )
            axes[row][3].set_title(label, fontsize=7)
        else:
            strips = torch.stack([reference[row], candidate[row], candidate[row] - reference[row]])
            axes[row][0].imshow(strips.numpy(), aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1)
            axes[row][0].set_yticks([0, 1, 2], ["reference", "modified", "difference"], fontsize=7)
            axes[row][0].set_title(f"input {row}: {label}", fontsize=8)
            axes[row][0].set_xlabel("token", fontsize=7)
    if spatial:
        for ax, title in zip(axes[0], ("input", "reference", "modified", "difference")):
            ax.set_title(f"{title}\n{ax.get_title()}".strip(), fontsize=8)
    fig.suptitle(
        f"{found.method} at {found.layer}: mean cosine {found.mean_cosine:.3f}, "
        f"top-{found.top_k:.0%} overlap {found.mean_overlap:.3f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def _image_row(axes: Any, image: Any, reference: Any, candidate: Any) -> None:
    shown = None
    if image is not None:
        picture = image.float()
        picture = picture.permute(1, 2, 0) if picture.shape[0] in (3, 4) else picture[0]
        shown = ((picture - picture.min()) / (picture.max() - picture.min() + 1e-12)).numpy()
    for ax, values, cmap in ((axes[1], reference, "jet"), (axes[2], candidate, "jet")):
        if shown is not None:
            ax.imshow(shown, cmap="gray" if shown.ndim == 2 else None)
        ax.imshow(values.numpy(), cmap=cmap, alpha=0.5 if shown is not None else 1.0, vmin=0, vmax=1)
    if shown is not None:
        axes[0].imshow(shown, cmap="gray" if shown.ndim == 2 else None)
    axes[3].imshow((candidate - reference).numpy(), cmap="RdBu_r", vmin=-1, vmax=1)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
