"""Every Python example in the README and the documentation site runs as written, the
figures they quote are the figures they print, and the site builds strictly."""

from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path

import pytest
from cli_runner import run_cli  # tests/cli_runner.py

from surgery.cli.steps import STEPS
from surgery.core.layer_kinds import LAYER_KINDS
from surgery.core.verbs import VERBS
from surgery.ops.export.format_table import EXPORT_FORMATS
from surgery.ops.numerics.grid import OBSERVERS
from surgery.ops.numerics.weight_methods import WEIGHT_METHODS
from surgery.ops.sparsity.criteria import CRITERIA
from surgery.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BUILT_IN = {registry: set(registry.names()) for registry in (CRITERIA, OBSERVERS, WEIGHT_METHODS, STEPS, TASKS,
                                                             EXPORT_FORMATS, LAYER_KINDS, VERBS)}  # fmt: skip


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
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra (make docs installs it)")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(config_file=str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # in this process, as `mkdocs build --strict` runs it: a warning raises Abort
    assert (tmp_path / "site" / "index.html").is_file()


def blocks_of(page: str) -> list[str]:
    return [code for name, _, code in BLOCKS if name == page]


def test_extending_shows_each_extension_point_in_one_short_example():
    examples = blocks_of("extending.md")
    doors = ["@verb(", "register_criterion", "register_observer", "attach_transform", "capture", "register_weight_method",
             "register_step", "register_heads", "register_task", "register_export_format", "register_layer_kind"]  # fmt: skip
    for door in doors:
        longest = 40 if door == "@verb(" else 25  # a verb from scratch, its spec, handler and use
        assert any(door in code and len(code.strip().splitlines()) <= longest for code in examples), door


def test_the_calibrated_compression_example_prints_the_figures_it_quotes(capsys):
    [code, *_] = blocks_of("calibrated.md")
    exec(compile(code, "calibrated example", "exec"), {})
    printed = [float(line) for line in capsys.readouterr().out.split()]
    quoted = [float(x) for x in re.findall(r"# (0\.\d+)", code)]
    assert printed == pytest.approx(quoted, abs=0.0015)


# ------------------------------------------------------------------ the commands the pages quote

COMMAND = re.compile(r"python -m surgery\b[^`#\n\\]*(?:\\\n[^`#\n\\]*)*")
NEEDS_A_FILE = ("ckpt.pth", "FOLDER", "PATH/", "data.root=images")  # placeholders for the reader's own files


def shell_commands() -> list[tuple[str, int, str, str]]:
    """(page, line, command, what the page says of it) of every ``python -m surgery`` the pages
    quote: a fenced one's ``# comment``, an inline one's paragraph. One that fails a check says
    so (``CHECK FAILED`` or ``exits 1``) and why."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in COMMAND.finditer(text):
            command = match.group(0).replace("\\\n", " ").strip()
            rest = text[match.end() :]
            if rest.startswith("`"):  # inline: what the rest of its paragraph says about it
                comment = rest[1:].split("\n\n", 1)[0].replace("\n", " ")
            else:  # fenced: its # comment
                line_rest = rest.split("\n", 1)[0].lstrip()
                comment = line_rest[1:].strip() if line_rest.startswith("#") else ""
            found.append((page.name, text[: match.start()].count("\n") + 1, command, comment))
    return found


COMMANDS = shell_commands()
COMMAND_IDS = [f"{page}:{line}" for page, line, _, _ in COMMANDS]


def fails_a_check(comment: str) -> bool:
    """Whether the page says the command ends in CHECK FAILED (exit 1)."""
    return "CHECK FAILED" in comment or "exits 1" in comment


def overrides_of(command: str) -> tuple[list[str], bool]:
    """The overrides of a quoted command (each sweep at its first value) and whether it sweeps."""
    import shlex

    words = shlex.split(command)[3:]
    sweep = "-m" in words
    overrides = [w for w in words if w != "-m"]
    if sweep:  # a job of the sweep: compose validates the keys and values it gets
        overrides = [o.split(",")[0] if "=" in o and "{" not in o else o for o in overrides]
    return overrides, sweep


def test_the_pages_quote_commands():
    assert len(COMMANDS) >= 20 and sum(fails_a_check(comment) for *_, comment in COMMANDS) >= 3


@pytest.mark.parametrize("page,line,command,comment", COMMANDS, ids=COMMAND_IDS)
def test_every_quoted_command_composes_into_a_valid_config(page, line, command, comment):
    """Each quoted command's overrides compose and convert (a typo or a key the config lacks is
    caught here, in a fraction of a second); one that fails a check says so and why."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from surgery.cli.config_loading import load_config

    overrides, _ = overrides_of(command)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
        container = OmegaConf.to_container(cfg, resolve=False)
    container["recipe"] = container.pop("hydra")["runtime"]["choices"]["recipe"]
    if any(placeholder in command for placeholder in NEEDS_A_FILE):
        return  # the reader's own file: composing is all that can be checked
    load_config(container)
    if fails_a_check(comment):
        assert re.search(r"cosine|bound|fails", comment), f"say why it fails a check: {comment!r}"


def heavy(command: str) -> bool:
    """A sweep, or a run of a full-size ImageNet model: minutes each on two cores."""
    full_size = ("recipe=prune_resnet50" in command or "recipe=quantize_resnet50" in command) and not any(
        small in command
        for small in ("model.name=resnet18", "model=timm", "model=factory", "mobilenet", "+select_only")
    )
    return " -m " in command or full_size


@pytest.mark.slow
@pytest.mark.parametrize("page,line,command,comment", COMMANDS, ids=COMMAND_IDS)
def test_every_quoted_command_runs_as_written(page, line, command, comment, tmp_path):
    """As the reader types it: exit 0, or exit 1 with CHECK FAILED where the page says so. The
    suite runs the commands that take seconds; ``make docs-commands`` runs every one (sweeps and
    full-size ImageNet models too, whose configs the test above composes in any case)."""
    if any(placeholder in command for placeholder in NEEDS_A_FILE):
        pytest.skip("stands for the reader's own file")
    if heavy(command) and os.environ.get("SURGERY_DOCS_COMMANDS") != "all":
        pytest.skip("a sweep or a full-size model: make docs-commands runs it")
    _, sweep = overrides_of(command)
    import shlex

    where = f"hydra.sweep.dir={tmp_path}" if sweep else f"hydra.run.dir={tmp_path}"
    args = [*shlex.split(command)[3:], where]
    result = run_cli(*args, cwd=ROOT)
    if fails_a_check(comment):
        assert result.returncode == 1 and "CHECK FAILED" in result.stdout, result.stderr[-2000:]
    else:
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
