"""Every example of the README's "Write your own" section runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from surgery.ops.criteria import CRITERIA
from surgery.ops.observers import OBSERVERS

README = Path(__file__).resolve().parents[1] / "README.md"


def write_your_own_examples() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Write your own") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_section_has_a_criterion_an_observer_a_transform_and_capture_each_within_15_lines():
    examples = write_your_own_examples()
    assert len(examples) == 4
    assert [len(code.strip().splitlines()) <= 15 for code in examples] == [True] * 4
    assert [
        "register_criterion" in examples[0],
        "register_observer" in examples[1],
        "attach_transform" in examples[2],
        "capture" in examples[3],
    ] == [True] * 4


@pytest.mark.parametrize("index", range(4), ids=["criterion", "observer", "transform", "capture"])
def test_example_runs(index):
    try:
        exec(compile(write_your_own_examples()[index], f"README example {index}", "exec"), {})
    finally:
        CRITERIA.unregister("wanda_demo")
        OBSERVERS.unregister("absmax_demo")


def test_the_calibrated_compression_example_prints_the_figures_it_quotes(capsys):
    text = README.read_text()
    section = text[text.index("### Calibrated compression") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    exec(compile(code, "README calibrated example", "exec"), {})
    printed = [float(line) for line in capsys.readouterr().out.split()]
    quoted = [float(x) for x in re.findall(r"# (0\.\d+)", code)]
    assert printed == pytest.approx(quoted, abs=0.0015)


def test_the_shrinking_example_prints_what_it_quotes(capsys):
    pytest.importorskip("transformers")
    text = README.read_text()
    section = text[text.index("### Shrinking: channels and heads removed for real") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    exec(compile(code, "README shrinking example", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert printed == re.findall(r"# (\S+)\n", code) == ["2", "True"]
