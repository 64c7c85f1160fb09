"""The architecture, enforced: imports flow cli -> analysis/ops -> core, and the library
imports without the app's packages."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import surgery

PACKAGE = Path(surgery.__file__).resolve().parent
LAYERS = {"core": 0, "ops": 1, "analysis": 1, "tasks": 2, "cli": 3}
# ops/ by family, lowest first: a family imports only families of a lower rank (lazy imports too);
# families of one rank never import each other. The modules at ops/'s top (rewriting.py,
# formats/) are shims of old paths that warn.
OPS_ORDER = {
    "numerics": 0,
    "build": 1,
    "experts": 1,
    "second_order": 2,
    "shrink": 3,
    "offload": 3,
    "sparsity": 4,
    "equivalence": 4,
    "quantization": 5,
    "training": 6,
    "export": 6,
    "sensitivity": 6,
    "rewrite": 6,
    "planning": 7,
}
OPS_SHIMS = {"rewriting.py", "formats"}
APP_ONLY = ("hydra", "omegaconf", "matplotlib", "sklearn")
ALLOWED_APP_ONLY = {"cli": set(APP_ONLY), "tasks": {"sklearn"}}  # tasks: the digits data set comes from sklearn


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "surgery" and parts[1] in LAYERS else None


def wrong_way_imports() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = path.relative_to(PACKAGE).parts[0]
        if own not in LAYERS:
            continue
        for module in imported_modules(path):
            other = layer_of(module)
            if other is None or other == own:
                top = module.split(".")[0]
                if top in APP_ONLY and top not in ALLOWED_APP_ONLY.get(own, set()):
                    problems.append(f"{path.relative_to(PACKAGE)} imports {module} (an app-only package)")
                continue
            if LAYERS[other] >= LAYERS[own]:  # upwards, or sideways between ops and analysis
                problems.append(f"{path.relative_to(PACKAGE)} ({own}) imports {module} ({other})")
    return problems


def family_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["surgery", "ops"] and parts[2] in OPS_ORDER else None


def wrong_way_family_imports() -> list[str]:
    """Imports inside ops/ that go up the family order, or sideways between families of a rank."""
    problems = []
    ops = PACKAGE / "ops"
    for path in sorted(ops.rglob("*.py")):
        parts = path.relative_to(ops).parts
        if parts[0] in OPS_SHIMS or len(parts) == 1:
            continue
        own = parts[0]
        for module in imported_modules(path):
            other = family_of(module)
            if other is not None and other != own and OPS_ORDER[other] >= OPS_ORDER[own]:
                problems.append(f"ops/{'/'.join(parts)} ({own}) imports {module} ({other})")
    return problems


def surgery_imports(path: Path) -> set[str]:
    """The surgery modules ``path`` imports: at the top, lazily, and for type checking alone (a
    circle of type-only imports is a circle of concerns all the same)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("surgery"):
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("surgery")}
    return found


def import_cycles() -> list[list[str]]:
    """Circles among surgery's modules (a module importing one that imports it back)."""
    modules = {
        ".".join(("surgery", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }
    edges = {name: {m for m in surgery_imports(path) if m in modules and m != name} for name, path in modules.items()}
    cycles, state = [], {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for other in sorted(edges[name]):
            if state.get(other) == "open" and not other.startswith(f"{name}.") and not name.startswith(f"{other}."):
                cycles.append(trail[trail.index(other) :] + [other] if other in trail else [name, other])
            elif other not in state:
                visit(other, [*trail, other])
        state[name] = "done"

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])
    return cycles


def test_ops_families_import_only_families_below_them():
    assert sorted(OPS_ORDER) == sorted(
        p.name for p in (PACKAGE / "ops").iterdir() if p.is_dir() and p.name not in OPS_SHIMS | {"__pycache__"}
    )
    assert wrong_way_family_imports() == []


def test_no_module_imports_one_that_imports_it_back():
    assert import_cycles() == []


def test_the_family_check_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "surgery"
    (fake / "ops" / "numerics").mkdir(parents=True)
    (fake / "ops" / "numerics" / "bad.py").write_text("def f():\n    from surgery.ops.export.exporting import export\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert wrong_way_family_imports() == [
        "ops/numerics/bad.py (numerics) imports surgery.ops.export.exporting (export)"
    ]


def test_imports_flow_from_cli_through_analysis_and_ops_to_core():
    assert wrong_way_imports() == []


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The check itself can fail: a core module importing ops is reported."""
    fake = tmp_path / "surgery"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "bad.py").write_text("from surgery.ops.sparsity.pruning import prune\nimport hydra\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert sorted(wrong_way_imports()) == [
        "core/bad.py (core) imports surgery.ops.sparsity.pruning (ops)",
        "core/bad.py imports hydra (an app-only package)",
    ]


BLOCKED = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {APP_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, Block())
"""

# What only a new interpreter can show, as snippets run in turn in one interpreter per group (each
# start costs seconds): BLOCKED's, where the app's packages cannot be imported, and a plain one,
# whose first snippet is the first to import surgery. A snippet prints what its test checks.
WITHOUT_THE_APP = {
    "library": """
import torch, surgery, surgery.testing
from torch import nn
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
x = torch.randn(3, 4)
with surgery.prune(model, 0.5, calibration=[x]) as handle, surgery.capture(model) as seen:
    model(x)
    drift = surgery.compare(model, model, x)
assert handle.sparsity() > 0 and seen.outputs and drift.identical
assert not [m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'matplotlib', 'sklearn')]
print("ok")
""",
    "command line": "import runpy; runpy.run_module('surgery', run_name='__main__')",  # ends in SystemExit
}
FIRST_IMPORT = {
    "hessian": "import surgery.core.capture as c; print('hessian' in c.REDUCTIONS.names())",
    "operator": """
import sys, torch, surgery
from torch import nn
assert "torch._dynamo" not in sys.modules
assert not hasattr(torch.ops.surgery, "enforce"), "import surgery defined an operator"
model = nn.Sequential(nn.Linear(4, 4))
surgery.prune(model, 0.5).restore()
assert "torch._dynamo" not in sys.modules, "a verb loaded dynamo"
assert hasattr(torch.ops.surgery, "enforce")
import torch._dynamo
assert torch._dynamo.config.skip_nnmodule_hook_guards is True  # untouched until a verb runs with dynamo loaded
surgery.prune(model, 0.5).restore()
assert torch._dynamo.config.skip_nnmodule_hook_guards is False
print("ok")
""",
    "old paths": """
warnings.simplefilter('always')
with warnings.catch_warnings(record=True) as seen:
    from surgery.ops.rewriting import Cast
    from surgery.ops.formats.sparse_linear import semi_structured
import surgery.ops.rewrite.rewriting as new
assert Cast is new.Cast and semi_structured.__module__ == 'surgery.ops.export.formats.sparse_linear'
print(sorted(str(w.message).split(' moved')[0] for w in seen if w.category is DeprecationWarning))
""",
    "grid spec": """
warnings.simplefilter('error')
import surgery
try:
    surgery.QuantSpec
except DeprecationWarning as warning:
    print(warning)
warnings.simplefilter('ignore')
from surgery import QuantSpec
assert QuantSpec is surgery.GridSpec and QuantSpec(bits=4).bits == 4
""",
}
SNIPPETS_IN_TURN = """
import contextlib, io, json, sys, traceback, warnings
results = {}
for name, code in json.loads(sys.argv[1]).items():
    printed = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
        try:
            exec(code, {"sys": sys, "warnings": warnings})
            error = None
        except SystemExit as end:
            error = f"SystemExit: {end.code}"
        except BaseException:
            error = traceback.format_exc()
    results[name] = {"printed": printed.getvalue().strip(), "error": error}
print(json.dumps(results))
"""


NEW_INTERPRETER = pytest.mark.xdist_group("new interpreter")  # one worker runs these tests: one start a group


@functools.cache
def in_a_new_interpreter(group: str) -> dict[str, dict[str, str | None]]:
    """Each snippet of ``group`` ("without the app", "first import"), run in turn in one new
    interpreter: {name: {"printed": its stdout, "error": None, a traceback or "SystemExit: code"}}."""
    prelude, snippets = {"without the app": (BLOCKED, WITHOUT_THE_APP), "first import": ("", FIRST_IMPORT)}[group]
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    code = prelude + SNIPPETS_IN_TURN
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(snippets)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@NEW_INTERPRETER
def test_the_library_works_without_hydra_omegaconf_matplotlib_or_sklearn():
    found = in_a_new_interpreter("without the app")["library"]
    assert found == {"printed": "ok", "error": None}


@NEW_INTERPRETER
def test_the_command_line_without_its_extra_says_what_to_install():
    """``python -m surgery`` would print this line and exit 1 (a SystemExit with a message)."""
    found = in_a_new_interpreter("without the app")["command line"]
    assert found["error"] == (
        "SystemExit: surgery: error: the command line needs 'hydra'; install it with: pip install 'surgery[cli]'"
    )


@NEW_INTERPRETER
def test_the_hessian_reduction_is_registered_once_surgery_is_imported():
    """``capture(reduce="hessian")`` works as before the module left core: importing any part of
    surgery runs its package, which registers the reduction (moved here from
    tests/ops/second_order/test_hessians.py, to share its interpreter)."""
    assert in_a_new_interpreter("first import")["hessian"] == {"printed": "True", "error": None}


@NEW_INTERPRETER
def test_import_registers_no_operator_and_leaves_dynamo_alone():
    """No unowned global state: the custom op is defined by the first verb that attaches a
    transform, and dynamo's config is changed only once something has loaded dynamo."""
    assert in_a_new_interpreter("first import")["operator"] == {"printed": "ok", "error": None}


PRIVATE_TORCH = re.compile(
    r"\._(parameters|buffers|modules|forward_hooks|forward_pre_hooks|backward_hooks|backward_pre_hooks|version|base"
    r"|orig_mod|reversed_padding_repeated_twice|state_dict_hooks|load_state_dict_pre_hooks|global_\w+)\b"
    r"|_ConvNd|_BatchNorm|_NormBase|torch\.utils\._pytree|torch\._C\b|hooks_dict_ref|extra_dict_ref"
    r"|\"_forward(_pre)?_hooks\""
)


def private_torch_accesses() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE_TORCH.search(code) and not code.lstrip().startswith(('"', "'")):
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    return found


def test_every_private_pytorch_access_goes_through_compat():
    """torch's private API changes between releases: one file, surgery/core/_compat.py, holds it."""
    assert private_torch_accesses() == []


def test_tests_of_the_lower_layers_do_not_import_the_app():
    """tests/core, tests/ops, tests/analysis and tests/tasks test the library without the CLI."""
    tests = Path(__file__).resolve().parent
    offenders = [
        f"{path.relative_to(tests)} imports {module}"
        for layer in ("core", "ops", "analysis", "tasks")
        for path in sorted((tests / layer).glob("*.py"))
        for module in imported_modules(path)
        if module == "surgery.cli" or module.startswith("surgery.cli.")
    ]
    assert offenders == []


def test_the_cycle_check_sees_a_circle(tmp_path, monkeypatch):
    fake = tmp_path / "surgery"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "a.py").write_text("from surgery.core.b import g\n")
    (fake / "core" / "b.py").write_text("def g():\n    from surgery.core import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert import_cycles() == [["surgery.core.a", "surgery.core.b", "surgery.core.a"]]


@NEW_INTERPRETER
def test_old_import_paths_the_docs_used_still_work_and_warn():
    found = in_a_new_interpreter("first import")["old paths"]
    assert found == {"printed": "['surgery.ops.formats', 'surgery.ops.rewriting']", "error": None}


@NEW_INTERPRETER
def test_the_grid_spec_old_name_still_works_and_warns():
    found = in_a_new_interpreter("first import")["grid spec"]
    assert found["error"] is None and found["printed"].startswith("QuantSpec is now GridSpec")


def test_the_ops_package_docstring_names_every_family():
    import surgery.ops

    missing = [family for family in OPS_ORDER if f"``{family}``" not in surgery.ops.__doc__]
    assert missing == []


def test_no_file_of_the_library_is_over_600_lines():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


def test_the_wheel_lists_every_package_of_the_library():
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found - listed == set()
