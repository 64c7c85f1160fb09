"""A step written before 0.3 defines its reporting and check hooks on the ``Step`` itself
(``summary``, ``preview``...): they are adopted into its ``reporting`` and ``checking``, with a
``DeprecationWarning``, until 0.4."""

from __future__ import annotations

import warnings
from typing import Any

REPORT_HOOKS = ("report", "summary", "markdown", "plots", "files", "sparsity", "offloaded_stages")
CHECK_HOOKS = ("neutral", "preview", "reattach", "activation_qparams", "fresh_build")


def adopt_hooks_on_the_step(step: Any) -> None:
    """Give ``step`` a ``reporting`` and a ``checking`` that call the hooks its class defines
    itself (each other hook: the one it held), warning once per step class."""
    own = [name for name in (*REPORT_HOOKS, *CHECK_HOOKS) if _defined_below_step(type(step), name)]
    outputs = _defined_below_step(type(step), "outputs")
    if not own and not outputs:
        return
    moved = ", ".join([*own, *(["outputs"] if outputs else [])])
    warnings.warn(
        f"step {step.name!r} defines {moved} on the Step; since 0.3 they belong to its reporting (a "
        "surgery.cli.steps.StepReport) and checking (a StepChecks); the Step's own are used until 0.4",
        DeprecationWarning,
        stacklevel=3,
    )
    report_hooks = [name for name in own if name in REPORT_HOOKS]
    check_hooks = [name for name in own if name in CHECK_HOOKS]
    step.reporting = _forwarding(type(step.reporting), step, report_hooks, step.reporting, outputs)
    step.checking = _forwarding(type(step.checking), step, check_hooks, step.checking, False)


def _defined_below_step(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if klass.__module__ == "surgery.cli.steps.base" and klass.__name__ == "Step":
            return False
        if name in vars(klass):
            return True
    return False


def _forwarding(base: type, step: Any, hooks: list[str], held: Any, outputs: bool) -> Any:
    """An instance of a subclass of ``base`` whose ``hooks`` call ``step``'s methods and whose
    other methods are ``held``'s."""
    members: dict[str, Any] = {name: _calling(step, name) for name in hooks}
    members.update({name: _calling(held, name) for name in _methods(base) if name not in hooks})
    if outputs:
        members["outputs"] = tuple(type(step).outputs)
    return type(f"{type(step).__name__}{base.__name__}", (base,), members)()


def _calling(owner: Any, name: str) -> Any:
    bound = getattr(owner, name)
    return lambda self, *args, **kwargs: bound(*args, **kwargs)


def _methods(cls: type) -> list[str]:
    return [name for name in (*REPORT_HOOKS, *CHECK_HOOKS) if callable(getattr(cls, name, None))]


class HooksBefore03:
    """The hooks a step held itself before 0.3, still answered until 0.4 (``step.summary(report)``
    from outside, a pre-0.3 subclass's ``super().report(...)``): each calls its class's
    ``reporting`` or ``checking`` (the step's own, as declared, never the adopted forwarding one)."""


def _delegating(owner: str, name: str) -> Any:
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(type(self), owner), name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"Deprecated: ``{owner}.{name}`` (until 0.4)."
    return hook


for _name in REPORT_HOOKS:
    setattr(HooksBefore03, _name, _delegating("reporting", _name))
for _name in CHECK_HOOKS:
    setattr(HooksBefore03, _name, _delegating("checking", _name))
