"""Exception classes raised by surgery for bad input and failed undo."""

from __future__ import annotations

import re


class SurgeryError(Exception):
    """Base class of every error surgery raises on purpose."""


NO_VALUE = type("NoValue", (), {"__repr__": lambda self: "NO_VALUE"})()  # a field that has no value to show


class ConfigError(SurgeryError, ValueError):
    """A configuration field has a value outside what is allowed.

    The message always reads ``FIELD=VALUE: what is allowed`` (``FIELD: what is allowed``
    when there is no value, e.g. an unknown key) so the CLI can print it as is.
    """

    def __init__(self, field: str, value: object, allowed: str, hint: str = "") -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.hint = hint
        message = f"{field}: {allowed}" if value is NO_VALUE else f"{field}={_short(value)}: {allowed}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut in the middle when longer than ``limit`` (a 400-digit number, say);
    strings (paths, patterns) are shown whole."""
    text = repr(value)
    if len(text) <= limit or isinstance(value, str):
        return text
    return f"{text[: limit // 2]}...{text[-limit // 4 :]} ({len(text)} characters)"


class ConfigTypeError(ConfigError, TypeError):
    """A configuration field has a value of the wrong type."""


class SelectionError(ConfigError):
    """A selection pattern matched no module of the model."""


class NoCalibrationInputError(ConfigError):
    """A selected layer received no floating-point input while calibrating (for a layer of an
    expert: its router sent it no token)."""


class OutputExistsError(ConfigError, FileExistsError):
    """An output file already exists and replacing it was not asked for."""

    def __init__(self, path: str) -> None:
        super().__init__("output", path, "already exists; pass overwrite=True to replace it")


class OutputWriteError(ConfigError, OSError):
    """An output could not be written (a full disk, a read-only folder, a file where a folder
    should be); an ``OSError`` too, with the system's ``errno``, ``strerror`` and ``filename``."""

    def __init__(self, field: str, path: str, err: OSError) -> None:
        reason = err.strerror or str(err) or type(err).__name__
        super().__init__(field, path, f"cannot be written ({reason}); nothing was written")
        self.errno, self.strerror, self.filename = err.errno, reason, err.filename or path

    def __str__(self) -> str:
        return str(self.args[0])  # the one line, not OSError's "[Errno N] ..."


class OutputBusyError(ConfigError):
    """Another run is writing into the same output folder now."""

    def __init__(self, folder: str) -> None:
        super().__init__(
            "output",
            folder,
            "another run is writing into this folder now; wait for it to finish or choose another folder",
        )


class CheckpointError(SurgeryError, ValueError):
    """A checkpoint is missing, corrupted, unsafe or does not fit the model."""


class AlreadyModifiedError(SurgeryError, RuntimeError):
    """A tensor already has surgery of the same kind attached."""


class UndoError(SurgeryError, RuntimeError):
    """One or more undo steps failed; every other step still ran."""

    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        lines = "; ".join(f"{type(f).__name__}: {f}" for f in failures)
        super().__init__(f"{len(failures)} undo step(s) failed: {lines}")


class ParameterReplacedError(SurgeryError, RuntimeError):
    """A parameter under surgery was replaced by a new object (``load_state_dict(assign=True)``,
    assignment), which the surgery does not reach: ``handle.enforce()`` carries it over."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(err: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``err``, its first line, at most ``limit`` characters: how a one-line
    error quotes the exception a library raised beneath it."""
    text = _ANSI.sub("", f"{type(err).__name__}: {err}".strip().splitlines()[0])  # a library's colours out
    return text if len(text) <= limit else text[: limit - 3] + "..."
