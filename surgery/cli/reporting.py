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
from surgery.cli.formatting import fmt, pyplot, save_figure
from surgery.cli.steps.base import Step, step_named
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
    for step in steps_of(report) if plots else []:
        for name, draw in step.reporting.plots(report).items():
            written.append(out_dir / name)
            write_atomically(written[-1], lambda tmp, draw=draw: draw(report, tmp))
    return written


def steps_of(report: dict[str, Any]) -> list[Step]:
    """The registered steps a report's run applied, in order (each once)."""
    return [step_named(name) for name in dict.fromkeys(report.get("steps", []))]


def headline(report: dict[str, Any]) -> list[str]:
    """What the run did, step by step (each step's own words), and the task's metric before and
    after; an indented line continues the one above (``report.md`` shows it in the step's section)."""
    lines = [line for step in steps_of(report) for line in step.reporting.summary(report)]
    if "accuracy" in report:
        acc = report["accuracy"]
        if "before_finetune" in acc:
            told = f"unmodified {acc['reference']:.4f}  after surgery {acc['before_finetune']:.4f}  after fine-tuning"
        else:
            told = f"reference {acc['reference']:.4f}  candidate"
        lines.append(f"accuracy: {told} {acc['candidate']:.4f}  drop {acc['drop_points']:.2f} points")
    if "perplexity" in report:
        ppl = report["perplexity"]
        lines.append(f"perplexity (held out): reference {ppl['reference']:.3f}  candidate {ppl['candidate']:.3f}")
    return lines + runtime_lines(report.get("deploy") or {})


def runtime_lines(deploy: dict[str, Any]) -> list[str]:
    """One line for each runtime the export is also made for (``deploy.llama_cpp``): its figures
    against the simulation, or why it was not measured."""
    lines = []
    for name, figures in deploy.items():
        if not isinstance(figures, dict) or not ("holds" in figures or "skipped" in figures):
            continue
        if "skipped" in figures or "error" in figures:
            lines.append(
                f"{name}: not measured ({figures['skipped']})"
                if "skipped" in figures
                else f"{name}: FAILED ({figures['error']})"
            )
            continue
        metric = next((f"  {k} {v:.3f}" for k, v in figures.items() if k == "perplexity"), "")
        verdict = "" if figures["holds"] else f"  MISSES {figures['expected']}"
        told = f"cosine to the simulation mean {figures['cosine_mean']:.5f} min {figures['cosine_min']:.4f}"
        lines.append(f"{name}: {told}  top-1 {figures['top1_agreement']:.3f}{metric}{verdict}")
    return lines


def plot_gradients(report: dict[str, Any], path: Path) -> None:
    """Each layer's share of the loss sensitivity (Σ|w·∂L/∂w|) and its gradient norm, in model order."""
    plt = pyplot()
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
    save_figure(fig, path)


def plot_layer_drift(report: dict[str, Any], path: Path) -> None:
    """Per-layer drift by depth (cosine and SQNR), with per-layer sparsity when pruned."""
    plt = pyplot()
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
    save_figure(fig, path)


def plot_sparsity(report: dict[str, Any], path: Path) -> None:
    """Horizontal bar chart of per-layer sparsity, in model order."""
    plt = pyplot()
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
    save_figure(fig, path)


def render_markdown(report: dict[str, Any]) -> str:
    """The human-readable report: outcome, checks, drift, timings and per-layer table."""
    lines: list[str] = []
    for section in MARKDOWN_SECTIONS:
        lines += section(report)
    return "\n".join(lines) + "\n"


def _markdown_header(report: dict[str, Any]) -> list[str]:
    """Outcome, parameters, each step's headline and the task's metric, and the checks."""
    lines = [
        f"# surgery report: {report['recipe']}",
        "",
        f"Model `{report['model']}` — **{'all checks passed' if report['ok'] else 'a check FAILED'}**; "
        f"{report['params']['total']:,} parameters.",
        "",
        *[f"- {line.removesuffix(':')}" for line in headline(report) if not line.startswith(" ")],
        "",
        "## Checks",
        "",
        "| check | passed | value | threshold | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {c['name']} | {fmt(c['passed'])} | {fmt(c['value'])} | {fmt(c['threshold'])} | {c['detail']} |"
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


def _markdown_drift(report: dict[str, Any]) -> list[str]:
    """Drift, timings and the per-layer table."""
    lines: list[str] = []
    drift = report["drift"]
    sqnr = "∞ (identical)" if drift["sqnr_db"] is None and drift["max_abs"] == 0 else fmt(drift["sqnr_db"])
    lines += [
        "",
        "## Drift (original vs modified)",
        "",
        "| max abs | cosine | SQNR dB | top-1 agreement |",
        "| --- | --- | --- | --- |",
        f"| {fmt(drift['max_abs'])} | {fmt(drift['cosine'])} | {sqnr} | {fmt(drift['top1_agreement'])} |",
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
        f"| `{row['name']}` | {row['type']} | {fmt(row['sparsity'])} | {fmt(row.get('cosine'))} | "
        f"{fmt(row.get('sqnr_db'))} | {fmt(row.get('max_abs'))} |"
        for row in report["layers"]
    ]
    return lines


def _markdown_selection_and_inspection(report: dict[str, Any]) -> list[str]:
    """What each step selected and skipped; module calls and gradients."""
    lines: list[str] = []
    for kind, selection in report.get("selection", {}).items():
        coverage = selection.get("coverage")
        reach = (
            f" ({coverage['share']:.1%} of the parameters, {coverage['changed_bytes']:,} of {coverage['total_bytes']:,} bytes)"
            if coverage
            else ""
        )
        lines += ["", f"## Selection: {kind}", "", f"{len(selection['matched'])} weight(s) matched{reach}.", ""]
        if coverage and coverage["largest_left"]:
            lines += ["| largest left unchanged | bytes | why |", "| --- | --- | --- |"]
            lines += [f"| `{t['name']}` | {t['bytes']:,} | {t['reason']} |" for t in coverage["largest_left"]]
            lines.append("")
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
            f"| `{r['name']}` | {r['type']} | {fmt(r['share'])} | {fmt(r['sensitivity'])} | "
            f"{fmt(r['weight_grad_norm'])} | {fmt(r['grad_output_norm'])} |"
            for r in top
        ]
    return lines


def _markdown_steps(report: dict[str, Any]) -> list[str]:
    """Each step's own sections, in step order."""
    return [line for step in steps_of(report) for line in step.reporting.markdown(report)]


def _markdown_offloaded(report: dict[str, Any]) -> list[str]:
    """Memory and seconds per block of a run on an offloaded model."""
    lines = offloaded_lines(report)
    return ["", "## Offloaded", "", *[f"- {line.strip()}" for line in lines]] if lines else []


MARKDOWN_SECTIONS = (
    _markdown_header,
    _markdown_offloaded,
    _markdown_accuracy,
    _markdown_perplexity,
    _markdown_steps,
    _markdown_drift,
    _markdown_selection_and_inspection,
)


def selection_lines(report: dict[str, Any]) -> list[str]:
    """One line per step: how many weights it matched, and what it skipped."""
    lines = []
    for kind, selection in report.get("selection", {}).items():
        skipped = selection["skipped"]
        names = ", ".join(f"{s['name']} ({s['type']})" for s in skipped[:4]) + (" ..." if len(skipped) > 4 else "")
        coverage = selection.get("coverage")
        reach = f" ({coverage['share']:.0%} of the parameters)" if coverage else ""
        lines.append(
            f"{kind}: {len(selection['matched'])} weight(s) matched{reach}, {len(skipped)} skipped"
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
    if found.get("source_scheme"):
        lines.append(f"  source: {found['source_scheme']}, dequantized as each weight is read")
    for step, row in found["steps"].items():
        per_block = "n/a" if row["seconds_per_block"] is None else f"{row['seconds_per_block']:.2f} s"
        resumed = f", {row['resumed']} resumed from {row['work']}" if row["resumed"] else ""
        spilled = f", {_bytes(row['spilled_bytes'])} of activations spilled to disk" if row.get("spilled_bytes") else ""
        lines.append(f"  {step}: {row['blocks']} blocks, {per_block} per block{resumed}{spilled}")
    return lines


def summary_table(report: dict[str, Any]) -> str:
    """A short plain-text table for the terminal: the run, each step's headline and the task's
    metric, the selections, the checks and the drift."""
    drift = report["drift"]
    width = max(len(c["name"]) for c in report["checks"]) if report["checks"] else 8
    lines = [f"recipe {report['recipe']}  model {report['model']}  params {report['params']['total']:,}"]
    lines += [f"  {line}" for line in headline(report)]
    lines += [f"  {line}" for line in selection_lines(report)]
    for c in report["checks"]:
        value = "" if c["value"] is None else f"{c['value']:.4g}"
        lines.append(f"  {c['name']:<{width}}  {'PASS' if c['passed'] else 'FAIL'}  {value:>10}  {c['detail']}")
    sqnr = "inf" if drift["sqnr_db"] is None else f"{drift['sqnr_db']:.2f}"
    top1 = "n/a" if drift["top1_agreement"] is None else f"{drift['top1_agreement']:.3f}"
    lines.append(f"  drift: cosine {drift['cosine']:.4f}  SQNR {sqnr} dB  max abs {drift['max_abs']:.4g}  top-1 {top1}")
    lines += offloaded_lines(report)
    lines.append(f"  result: {'OK' if report['ok'] else 'CHECK FAILED'}")
    return "\n".join(lines)


def plot_attribution(found: AttributionDrift, path: Path) -> None:
    """The overlay grid: per input, the input, the reference's map, the modified model's map
    and their difference (images); for token maps, heat strips of the three per input."""
    plt = pyplot()
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
    save_figure(fig, path)


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
