"""spap's refusals: one hierarchy, so every entry point can tell a user error from a bug.

A ``SpapError`` says what is wrong and how to fix it; the ``spap`` command prints it as one line (no
traceback) and exits 2, as it does for the operating system's I/O errors on sources and outputs.
Anything else is a bug and keeps its traceback. The subclasses stay ``ValueError``/``RuntimeError``
so callers that caught those before still do.

``option`` writes a parameter the way the caller sets it: ``--overwrite`` on the command line,
``-p overwrite True`` under papermill, ``overwrite=True`` from Python.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar


class SpapError(Exception):
    """A refusal with its fix: bad input, an unreadable source, an output spap may not write."""


class ParameterError(SpapError, ValueError):
    """A parameter value that spap refuses (wrong type, out of range, unknown name)."""


class SourceError(SpapError, ValueError):
    """A model source that cannot be used as given: incomplete, truncated, or not matching its config."""


class ModelNotInstalled(SpapError, FileNotFoundError):
    """An offline model alias whose PyPI package is not installed here (the message names the install command)."""


class OutputError(SpapError, ValueError):
    """An output path spap refuses to write (foreign directory, source model, not writable, no space)."""


class TableError(SpapError, ValueError):
    """A result table that is damaged, edited by hand or mixed: refused before it is used or rewritten."""


class CheckpointError(SpapError, RuntimeError):
    """A pruned model that must not be saved (non-finite logits, a reload that differs)."""


class NumericalError(SpapError, RuntimeError):
    """Non-finite values where a finite prune is impossible (damaged weights, overflowing activations)."""


SURFACES = ("python", "cli", "papermill")
_surface: ContextVar[str] = ContextVar("spap_surface", default="python")


def set_surface(surface: str) -> None:
    """Who is calling: ``cli`` (the ``spap`` command), ``papermill`` (a notebook) or ``python``."""
    if surface not in SURFACES:
        raise ParameterError(f"surface must be one of {', '.join(SURFACES)}, got {surface!r}")
    _surface.set(surface)


@contextmanager
def surface(name: str):
    token = _surface.set(name)
    try:
        yield
    finally:
        _surface.reset(token)


def current_surface() -> str:
    return _surface.get()


# Keyword arguments whose command-line flag is not their name with dashes (``spap prune --out DIR``).
CLI_FLAGS = {"out_dir": "--out"}


def option_name(name: str) -> str:
    """The parameter ``name`` as the caller writes it, without a value: ``--out`` on the command line for
    ``out_dir``, ``--round-to`` for ``round_to``; the name itself in a notebook or from Python."""
    return CLI_FLAGS.get(name, "--" + name.replace("_", "-")) if _surface.get() == "cli" else name


def option(name: str, value=True) -> str:
    """``name`` set to ``value`` in the caller's language (``option("overwrite")`` → ``--overwrite``)."""
    where = _surface.get()
    if where == "cli":
        flag = option_name(name)
        return flag if value is True else f"{flag} {value}"
    if where == "papermill":
        return f"-p {name} {value}"
    return f"{name}={value!r}"
