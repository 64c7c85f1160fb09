"""Every private PyTorch API surgery touches, feature-checked once in one place.

Each helper either works on this PyTorch or falls back to something correct but slower, and
then warns once (:func:`fallback`) saying what is lost; none fails silently.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.nn.modules import module as _module_globals

from surgery.core.layer_kinds import classes_where

_log = logging.getLogger("surgery")

GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)
MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@functools.cache
def fallback(feature: str, consequence: str) -> None:
    """Warn once per process that ``feature`` is missing from this PyTorch, and what that costs."""
    warnings.warn(f"surgery: {feature} is not available in this PyTorch; {consequence}", RuntimeWarning, stacklevel=3)


OPTIMIZER_HOOK_DICTS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def global_hook_counts() -> dict[str, int]:
    """Entries in each of torch's global hook registries: modules (``torch.nn.modules.module``)
    and optimizer steps (``torch.optim.optimizer``)."""
    from torch.optim import optimizer

    counts = {name: len(getattr(_module_globals, name, {})) for name in GLOBAL_HOOK_DICTS}
    return counts | {name: len(getattr(optimizer, name, {})) for name in OPTIMIZER_HOOK_DICTS}


def module_hook_counts(model: nn.Module) -> dict[str, int]:
    """Hooks of each kind on each module of ``model`` and on each of its parameters (tensor
    hooks on gradients): ``{"<module>:<dict>": count}``, ``{"param <name>:<dict>": count}``."""
    counts = {
        f"{name}:{kind}": len(getattr(m, kind, {})) for name, m in model.named_modules() for kind in MODULE_HOOK_DICTS
    }
    return counts | {
        f"param {name}:{kind}": len(getattr(p, kind, None) or {})
        for name, p in model.named_parameters(remove_duplicate=False)
        for kind in TENSOR_HOOK_DICTS
    }


_ABSENT = object()


def full_backward_hook_flag() -> object:
    """Torch's record of which kind of global backward hook was registered (None: neither)."""
    return getattr(_module_globals, "_global_is_full_backward_hook", _ABSENT)


def set_full_backward_hook_flag(value: object) -> None:
    """Put that record back (removing the hook does not reset it)."""
    if value is not _ABSENT:
        _module_globals._global_is_full_backward_hook = value


def run_eagerly_when_called_directly(code: types.CodeType) -> None:
    """Tell dynamo to run ``code`` as plain Python when it is a frame of its own (a root hook
    called by ``Module._call_impl``) and inline it when called from a traced frame."""
    try:
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameAction.SKIP
        eval_frame.set_code_exec_strategy(code, eval_frame._FrameExecStrategy(skip, skip))
    except (ImportError, AttributeError, TypeError):
        fallback(
            "dynamo's per-code frame strategy",
            "hooks on a compiled model's root are compiled as graphs of their own (slower to compile, equally correct)",
        )


def mark_mutation_hidden_available() -> bool:
    """Whether functionalization can mark a parameter write hidden from autograd."""
    import torch

    return hasattr(torch, "_functionalize_mark_mutation_hidden_from_autograd")


def register_functional_rule(op: str, rule: Callable[..., Any], library: Any) -> bool:
    """Register ``rule`` for ``op`` under dynamo's functional tensor mode; False if impossible."""
    try:
        import torch
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        if not mark_mutation_hidden_available():
            raise AttributeError
        torch.library.register_torch_dispatch(op, FunctionalTensorMode, rule, lib=library)
        return True
    except (ImportError, AttributeError):
        fallback(
            "marking parameter writes hidden from autograd",
            "compiled graphs re-apply masks and quantization on every call (correct, slower)",
        )
        return False


def hook_guards_skipped() -> bool:
    """Whether dynamo currently skips guards on module hook dicts that were empty when traced."""
    from torch._dynamo import config

    return bool(getattr(config, "skip_nnmodule_hook_guards", False))


def guard_hook_dicts() -> list[types.CodeType]:
    """Make dynamo guard module hook dicts (``skip_nnmodule_hook_guards = False``) and return
    the code objects it compiled before, which were traced without those guards."""
    from torch._dynamo import config, convert_frame

    config.skip_nnmodule_hook_guards = False
    seen = convert_frame.input_codes.seen + convert_frame.output_codes.seen
    return [code for code in (ref() for ref in seen) if code is not None]


def dynamo_loaded() -> bool:
    """Whether anything in this process has imported dynamo (no ``torch.compile`` yet otherwise)."""
    return "torch._dynamo" in sys.modules


def compiled_wrapper_type() -> type | None:
    """``OptimizedModule`` if dynamo is loaded (a model cannot be compiled otherwise)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def wrapper_files() -> set[str]:
    """Files whose frames call module hooks under compile (``Module._call_impl``, wrappers)."""
    from torch._dynamo import external_utils

    return {nn.modules.module.__file__, external_utils.__file__}


def reset_code(code: types.CodeType) -> None:
    """Drop what dynamo compiled for one function (``torch._dynamo.reset()`` for one code)."""
    from torch._C._dynamo.eval_frame import reset_code as reset

    reset(code)


def functionalize_hiding_mutation(mode: Any, func: Any, args: tuple, kwargs: dict, mutated: list) -> Any:
    """Auto-functionalize an in-place custom op, then mark its writes to ``mutated`` hidden from
    autograd (so AOTAutograd does not bump their version counters on every call)."""
    import torch
    from torch._higher_order_ops.auto_functionalize import do_auto_functionalize, do_auto_functionalize_v2
    from torch._inductor import config as inductor_config

    functionalize = do_auto_functionalize_v2 if inductor_config.enable_auto_functionalized_v2 else do_auto_functionalize
    result = functionalize(mode, func, args, kwargs)
    for tensor in mutated:
        torch._functionalize_mark_mutation_hidden_from_autograd(tensor.elem)
    return result


# Thin views of the layer-kind table (surgery.core.layer_kinds, which code should read) for the
# places that still test isinstance against a fixed tuple: the built-in kinds only.
CONVOLUTIONS = classes_where(lambda kind: kind.convolution)
BATCH_NORMS = classes_where(lambda kind: kind.normalises == "channel")
CHANNEL_NORMS = (*BATCH_NORMS, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def get_slot(module: nn.Module, name: str, kind: str = "parameters") -> Tensor | None:
    """The raw entry ``name`` of a module's own parameters (or buffers): during a
    quantization-aware forward it may hold a plain tensor lent in place of the Parameter."""
    return getattr(module, f"_{kind}").get(name)


def set_slot(module: nn.Module, name: str, value: Tensor | None, kind: str = "parameters") -> None:
    """Put ``value`` in a module's own parameter (or buffer) entry without ``setattr``: no
    Parameter check and no global registration hook (a plain tensor may be lent for one
    forward; a rebuilt layer inside ``intercept`` must not fire its rules)."""
    getattr(module, f"_{kind}")[name] = value


def tree_leaves(value: Any) -> list[Any]:
    """The leaves of nested tuples, lists, dicts and registered containers (torch's pytree)."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(value)[0]


def view_base(tensor: Tensor) -> Tensor | None:
    """The tensor ``tensor`` is a view of (``Tensor._base``), or None when it owns its storage."""
    return tensor._base


def tensor_stamp(tensor: Tensor) -> tuple[int, int]:
    """(version counter, data pointer): changes whenever the tensor is written in place or replaced."""
    return tensor._version, tensor.data_ptr()


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiles (the model itself when it is not one)."""
    wrapper = compiled_wrapper_type()
    while wrapper is not None and isinstance(model, wrapper):
        model = model._orig_mod
    return model


def forward_hook_functions(module: nn.Module) -> list[Callable[..., Any]]:
    """Every forward and forward-pre hook function on ``module`` (ours and others')."""
    return [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]


def module_hooks(module: nn.Module) -> list[Any]:
    """Every forward, backward, state-dict or load hook registered on ``module`` itself (what a
    replacement layer would silently lose)."""
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
             "_load_state_dict_pre_hooks")  # fmt: skip
    return [hook for name in names for hook in (getattr(module, name, None) or {}).values()]


def module_has_hooks(module: nn.Module) -> bool:
    """Whether any hook of :func:`module_hooks` is registered on ``module`` itself."""
    return bool(module_hooks(module))


def hook_dicts(handle: Any) -> list[dict]:
    """The dicts a ``RemovableHandle`` removes its hook from (to snapshot and restore their order)."""
    found = [handle.hooks_dict_ref()] + [ref() for ref in getattr(handle, "extra_dict_ref", ())]
    return [d for d in found if d is not None]


def conv_padding(module: nn.Module) -> tuple[int, ...]:
    """The explicit padding ``F.pad`` takes for a convolution whose ``padding_mode`` is not zeros."""
    return module._reversed_padding_repeated_twice


def surgery_hook(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is surgery's own: a function, bound method or callable object defined in
    a ``surgery.`` module (a bound method's type is ``method``: its ``__module__`` is the function's)."""
    return str(getattr(hook, "__module__", None) or "").startswith("surgery.")


def drop_forward_hooks(model: nn.Module, dropped: Callable[[Callable[..., Any]], bool] = surgery_hook) -> int:
    """Remove, from every module of ``model`` (a copy: the handles of the original still own
    theirs), the forward and forward-pre hooks for which ``dropped(hook)`` holds (default:
    surgery's own); return how many."""
    count = 0
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for key in [k for k, hook in hooks.items() if dropped(hook)]:
                del hooks[key]
                count += 1
    return count


def quiet_pytree_deprecations() -> None:
    """torchao (imported by transformers when installed) registers enums as pytree constants,
    which torch 2.14 deprecates with one warning per enum on every run; the user cannot act on it."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
