"""How a one-line error quotes the exception a library raised beneath it."""

from __future__ import annotations

from surgery.core.errors import first_line


def test_a_quoted_library_error_keeps_its_first_line_without_terminal_colours():
    # torch.onnx's TorchExportError colours "This is step 1/3": the escape codes must not reach a report
    err = RuntimeError("Failed to export. \x1b[96mThis is step 1/3\x1b[0m of exporting.\nNext steps: ...")
    assert first_line(err) == "RuntimeError: Failed to export. This is step 1/3 of exporting."
    assert first_line(ValueError("x" * 400), limit=20) == "ValueError: xxxxx..."
