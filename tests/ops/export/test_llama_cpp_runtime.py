"""``report.json`` ``deploy.llama_cpp`` where llama.cpp cannot be reached: said in one line, or
(asked for and failing) a failed deploy check, never a silent pass. The figures themselves, from
llama.cpp, are tested in ``test_gguf_llama_cpp.py``."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from surgery.cli.checks import check_deploy
from surgery.ops.export.formats.gguf.file import write_gguf
from surgery.ops.export.formats.gguf.llama_cpp_runtime import PYTHON_VARIABLE, TIMEOUT_VARIABLE, llama_cpp_summary
from surgery.ops.export.parity import ExportRecord, Parity
from surgery.ops.numerics.deployment import ExportParts
from surgery.tasks.tinyllama import load_llama

IDS = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def written(tmp_path):
    model = load_llama()
    write_gguf(ExportParts(model), tmp_path / "m.gguf", {})
    return tmp_path / "m.gguf", model


def test_without_llama_cpp_the_section_says_how_to_get_it(written, monkeypatch):
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama_cpp is importable here: the section measures it")
    monkeypatch.delenv(PYTHON_VARIABLE, raising=False)
    path, model = written
    assert llama_cpp_summary(path, model, [IDS], None) == {
        "skipped": f"llama-cpp-python is not installed here (pip install llama-cpp-python, or {PYTHON_VARIABLE})"
    }


def test_a_named_python_that_is_not_there_fails_in_one_line(written, monkeypatch, tmp_path):
    # named on purpose: a typo must not pass as "not installed"
    monkeypatch.setenv(PYTHON_VARIABLE, str(tmp_path / "nowhere" / "python"))
    path, model = written
    found = llama_cpp_summary(path, model, [IDS], None)
    assert found["holds"] is False and found["error"] == f"{PYTHON_VARIABLE}={tmp_path}/nowhere/python is not a file"


def worker(tmp_path, name: str, body: str) -> str:
    script = tmp_path / name
    script.write_text(body)
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("#!/bin/sh\nexit 1\n", "did not run m.gguf: "),  # /bin/false: its pipe breaks, or it answers nothing
        ("not a program\n", "did not run m.gguf: PermissionError"),  # not executable
        ("#!/bin/sh\nread line; echo ok\n", "answered ok on m.gguf but wrote no logits"),
        (
            "#!/bin/sh\nsleep 100\n",
            r"gave no answer on m.gguf within 2 s \(SURGERY_LLAMA_CPP_TIMEOUT, .* in the comparison\)",
        ),
    ],
)
def test_a_named_python_that_fails_hangs_or_lies_fails_the_check_and_leaves_nothing(written, tmp_path, body, said):
    from surgery.ops.export.formats.gguf.llama_cpp_runtime import LlamaCpp, LlamaCppError, _compared

    path, model = written
    python = worker(tmp_path, "python", body)
    if body.startswith("not"):
        (tmp_path / "python").chmod(0o644)
    runtime = LlamaCpp(path, python, timeout=2)
    with pytest.raises(LlamaCppError, match=said), runtime:
        _compared(runtime, model, IDS, None)
    assert runtime.worker is None and not Path(runtime.folder.name).exists()  # ended (killed if need be), cleaned


def test_inputs_that_are_not_token_ids_are_said_in_one_line(written, monkeypatch):
    monkeypatch.setenv(PYTHON_VARIABLE, sys.executable)
    path, model = written
    for batch in (torch.randn(1, 16), {"input_ids": IDS, "attention_mask": torch.zeros(1, 16)}):
        assert llama_cpp_summary(path, model, [batch], None)["skipped"].startswith(
            "the export's inputs are not token ids"
        )


def test_a_named_python_without_llama_cpp_fails_the_deploy_check_in_one_line(written, monkeypatch):
    # this environment's own Python has no llama_cpp (it lives in the benchmark's venv): asked for
    # by name and not run, the deploy check fails rather than reporting the file as checked
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama_cpp is importable here")
    monkeypatch.setenv(PYTHON_VARIABLE, sys.executable)
    path, model = written
    section = llama_cpp_summary(path, model, [IDS], None)
    assert section["holds"] is False
    assert section["error"] == (
        f"llama.cpp ({sys.executable}) did not run m.gguf: error: ModuleNotFoundError: No module named 'llama_cpp'"
    )
    record = ExportRecord(path, "gguf", path.stat().st_size, parity=Parity(0.0, 1.0, True, "exact"))
    result = check_deploy(record, {"llama_cpp": section})
    assert not result.passed and "llama_cpp misses its bound (llama.cpp runs the file): llama.cpp (" in result.detail
    assert check_deploy(record, {"llama_cpp": {"skipped": "not installed"}}).passed  # not asked for: not a failure


def answering(tmp_path, logits: str) -> str:
    """A stand-in for llama.cpp's Python that answers ``ok`` to every request, having saved
    ``logits`` (a numpy expression of ``n`` sequences and ``L`` positions) as the logits."""
    return worker(
        tmp_path,
        "python",
        f"""#!{sys.executable}
import json, sys
import numpy as np
for line in sys.stdin:
    request = json.loads(line)
    ids = json.load(open(request["ids"]))
    n, L = len(ids), len(ids[0])
    np.save(request["out"], {logits})
    print("ok", flush=True)
""",
    )


@pytest.mark.parametrize(
    ("logits", "said"),
    [
        ("np.zeros((n, L, 7), np.float32)", r"logits of shape \(1, 16, 7\), not \(1, 16, 256\)"),
        ("np.zeros((n * L * 256,), np.float32)", r"logits of shape \(4096,\), not \(1, 16, 256\)"),
        ("np.zeros((n, L - 1, 256), np.float32)", r"logits of shape \(1, 15, 256\)"),
        ("np.zeros((n, L, 256), np.int64)", r"int64 values, not floating-point logits"),
        (
            "np.full((n, L, 256), np.nan, np.float32)",
            r"4096 NaN or Inf logits of 4096 \(first at sequence 0, position 0\)",
        ),
    ],
    ids=["vocabulary", "flat", "length", "integers", "nan"],
)
def test_every_answer_is_checked_and_a_bad_one_fails_the_deploy_check_in_one_line(
    written, tmp_path, monkeypatch, logits, said
):
    """Hostile pass, wave 4, item 7: wrong-shaped logits were a traceback (the run published nothing
    but app.log), a flat array was reshaped silently, NaN logits failed without a reason."""
    path, model = written
    monkeypatch.setenv(PYTHON_VARIABLE, answering(tmp_path, logits))
    section = llama_cpp_summary(path, model, [IDS], None)
    assert section["holds"] is False and section["expected"].startswith("llama.cpp answers finite")
    assert len(section["error"].splitlines()) == 1 and re.search(said, section["error"]), section["error"]
    record = ExportRecord(path, "gguf", path.stat().st_size, parity=Parity(0.0, 1.0, True, "exact"))
    assert not check_deploy(record, {"llama_cpp": section}).passed


def test_a_worker_that_hangs_is_bounded_over_the_whole_measurement(written, tmp_path, monkeypatch):
    """Hostile pass, wave 4, item 6: a hanging worker held the run 600 s per answer."""
    path, model = written
    monkeypatch.setenv(PYTHON_VARIABLE, worker(tmp_path, "python", "#!/bin/sh\nsleep 100\n"))
    monkeypatch.setenv(TIMEOUT_VARIABLE, "1.5")
    section = llama_cpp_summary(path, model, [IDS], None)
    assert (
        section["holds"] is False
        and section["expected"] == f"llama.cpp measures the file within {TIMEOUT_VARIABLE}=1.5 s"
    )
    assert "ran out in the comparison" in section["error"]
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv(TIMEOUT_VARIABLE, bad)
        assert llama_cpp_summary(path, model, [IDS], None)["error"] == (
            f"{TIMEOUT_VARIABLE}={bad} must be a positive number of seconds"
        )


def test_the_bound_covers_the_perplexity_pass_too(written, tmp_path, monkeypatch):
    path, model = written
    # the comparison's answer at once, then none: the perplexity pass waits out the bound (which leaves
    # a loaded machine room to start the worker)
    once = "np.zeros((n, L, 256), np.float32) if not hasattr(sys, 'seen') and not setattr(sys, 'seen', 1) "
    python = answering(tmp_path, once + "else __import__('time').sleep(1000)")
    monkeypatch.setenv(PYTHON_VARIABLE, python)
    monkeypatch.setenv(TIMEOUT_VARIABLE, "8")
    metric = ("perplexity", lambda runtime: runtime(IDS) is None or 1.0, False)
    section = llama_cpp_summary(path, model, [IDS], metric)
    assert section["holds"] is False and "ran out in the perplexity pass" in section["error"]


def test_a_worker_that_closes_its_output_but_runs_on_is_not_said_to_have_exited(written, tmp_path, monkeypatch):
    path, model = written
    monkeypatch.setenv(PYTHON_VARIABLE, worker(tmp_path, "python", "#!/bin/sh\nexec 1>&-\nsleep 30\n"))
    monkeypatch.setenv(TIMEOUT_VARIABLE, "3")  # close() then waits what is left
    section = llama_cpp_summary(path, model, [IDS], None)
    assert section["holds"] is False and "it closed its output (still running)" in section["error"]
