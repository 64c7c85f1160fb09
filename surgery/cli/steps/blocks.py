"""What a step that walks an offloaded model block by block reports: its blocks and the seconds
each took (the ``offloaded.steps`` section of ``report.json``)."""

from __future__ import annotations

from typing import Any

from surgery.ops.offload.offloaded_compression import OffloadedCompression


def block_stages(handle: OffloadedCompression) -> dict[str, Any]:
    """Stages, blocks, resumed blocks, mean seconds per block, bytes spilled and the work folder;
    on a GPU, each stage's peak GPU memory."""
    blocks = [s for stage, s in zip(handle.stages[handle.resumed :], handle.seconds) if stage.block]
    return {
        "stages": len(handle.stages),
        "blocks": handle.blocks,
        "resumed": handle.resumed,
        "seconds_per_block": sum(blocks) / len(blocks) if blocks else None,
        "spilled_bytes": handle.spilled_bytes,
        "work": str(handle.work),
    } | ({"gpu_peak_bytes": handle.gpu_peak_bytes} if handle.gpu_peak_bytes else {})
