"""Every Python example in the README and the documentation site runs as written, the
figures they quote are the figures they print, and the site builds strictly."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from surgery.cli.steps import STEPS
from surgery.ops.criteria import CRITERIA
from surgery.ops.exporting import EXPORT_FORMATS
from surgery.ops.observers import OBSERVERS
from surgery.ops.weight_methods import WEIGHT_METHODS
from surgery.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BUILT_IN = {registry: set(registry.names()) for registry in (CRITERIA, OBSERVERS, WEIGHT_METHODS, STEPS, TASKS,
                                                             EXPORT_FORMATS)}  # fmt: skip


def python_blocks() -> list[tuple[str, int, str]]:
    """(page, line, code) of every ```python fence."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            found.append((page.name, text[: match.start()].count("\n") + 1, match.group(1)))
    return found


BLOCKS = python_blocks()


@pytest.mark.parametrize("page,line,code", BLOCKS, ids=[f"{page}:{line}" for page, line, _ in BLOCKS])
def test_every_python_example_runs_as_written(page, line, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    if "transformers" in code or "timm" in code:
        pytest.importorskip("transformers" if "transformers" in code else "timm")
    module = types.ModuleType("docs_example")  # a real module: dataclasses look their class's module up
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, f"{page}:{line}", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
        for registry, names in BUILT_IN.items():
            for name in set(registry.names()) - names:
                registry.unregister(name)
    quoted = re.findall(r"print\(.*\)\s+# (-?\d+\.\d+|True|False|\d+)\b", code)
    if quoted:  # a print quoting its output in a comment must print exactly that (numbers within 0.0015)
        printed = capsys.readouterr().out.split()
        assert len(printed) >= len(quoted), printed
        for got, expected in zip(printed[-len(quoted) :], quoted):
            if re.fullmatch(r"-?\d+\.\d+", expected):
                assert float(got) == pytest.approx(float(expected), abs=0.0015)
            else:
                assert got == expected


def test_no_page_points_outside_the_repository():
    for page in PAGES:
        text = page.read_text()
        assert "PRODUCT.md" not in text and "../shared" not in text, page.name


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 300


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict`` fails on a broken link, a missing page or a missing image."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is in the dev extra (make docs installs it)")
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def blocks_of(page: str) -> list[str]:
    return [code for name, _, code in BLOCKS if name == page]


def test_extending_shows_each_extension_point_in_one_short_example():
    examples = blocks_of("extending.md")
    doors = ["register_criterion", "register_observer", "attach_transform", "capture", "register_weight_method",
             "register_step", "register_heads", "register_task", "register_export_format"]  # fmt: skip
    for door in doors:
        assert any(door in code and len(code.strip().splitlines()) <= 25 for code in examples), door


def test_the_calibrated_compression_example_prints_the_figures_it_quotes(capsys):
    [code, *_] = blocks_of("calibrated.md")
    exec(compile(code, "calibrated example", "exec"), {})
    printed = [float(line) for line in capsys.readouterr().out.split()]
    quoted = [float(x) for x in re.findall(r"# (0\.\d+)", code)]
    assert printed == pytest.approx(quoted, abs=0.0015)
