"""The architecture, enforced: imports flow cli -> analysis/ops -> core, and the library
imports without the app's packages."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import surgery

PACKAGE = Path(surgery.__file__).resolve().parent
LAYERS = {"core": 0, "ops": 1, "analysis": 1, "tasks": 2, "cli": 3}
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


def test_imports_flow_from_cli_through_analysis_and_ops_to_core():
    assert wrong_way_imports() == []


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The check itself can fail: a core module importing ops is reported."""
    fake = tmp_path / "surgery"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "bad.py").write_text("from surgery.ops.pruning import prune\nimport hydra\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert sorted(wrong_way_imports()) == [
        "core/bad.py (core) imports surgery.ops.pruning (ops)",
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


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_library_works_without_hydra_omegaconf_matplotlib_or_sklearn():
    result = run_python(
        BLOCKED
        + """
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
"""
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_command_line_without_its_extra_says_what_to_install():
    result = run_python(BLOCKED + "import runpy; runpy.run_module('surgery', run_name='__main__')")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "surgery: error: the command line needs 'hydra'; install it with: pip install 'surgery[cli]'"
    )


def test_import_registers_no_operator_and_leaves_dynamo_alone():
    """No unowned global state: the custom op is defined by the first verb that attaches a
    transform, and dynamo's config is changed only once something has loaded dynamo."""
    result = run_python("""
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
""")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


PRIVATE_TORCH = re.compile(
    r"\._(parameters|buffers|modules|forward_hooks|forward_pre_hooks|backward_hooks|backward_pre_hooks|version"
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
