"""Parameter validation shared by the API, the methods and the notebooks.

Every value a user can set is checked before any heavy work, and a refusal names the parameter,
what it got and what it takes. Nothing is silently coerced or ignored: a string ``"false"`` is not a
boolean, ``4.0`` is not a window count, and an unknown name is an error.

* ``Spec`` declares a value's type and range once; method hyperparameters carry one per dataclass
  field (``hp(...)``), run parameters call ``Spec.check`` directly.
* ``check_notebook_parameters`` is the first thing every notebook runs after papermill has injected
  its parameters: an undeclared name (a typo such as ``-p sparsty 0.5``) is refused, and each value
  is checked against the annotation of the parameters cell.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field

import yaml

from spap_lib.errors import ParameterError, option, option_name, set_surface

_TYPE_WORDS = {bool: "a boolean (True/False)", int: "an integer", float: "a number", str: "a string",
               dict: "a mapping", list: "a list"}


@dataclass(frozen=True)
class Spec:
    """What one parameter takes: a type, optional bounds (``ge``/``gt``/``le``/``lt``), optional
    ``choices`` and whether ``None`` is allowed. ``check`` returns the value unchanged or raises."""

    type: type | tuple  # a tuple: any of these types (``Union[int, str]``), each checked as plain ``isinstance``
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    optional: bool = False

    @classmethod
    def of(cls, annotation, **bounds) -> "Spec":
        """The spec of an annotation (``int``, ``Optional[int]``, ``dict``...) with ``bounds``."""
        base, optional = _base_type(annotation)
        return cls(type=base, optional=optional, **bounds)

    def describe(self) -> str:
        bounds = [f"{op} {bound:g}" for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                  if bound is not None]
        kinds = self.type if isinstance(self.type, tuple) else (self.type,)
        text = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in kinds)
        text += " " + " and ".join(bounds) if bounds else ""
        if self.choices:
            text = f"one of {', '.join(map(repr, self.choices))}"
        return text + (" or None" if self.optional else "")

    def check(self, name: str, value, where: str = ""):
        prefix = f"{where}: " if where else ""

        def refuse(why: str):
            shown = name if where else option_name(name)  # a run's parameter in the caller's words, not a field's
            raise ParameterError(f"{prefix}{shown} must be {self.describe()}, got {value!r} ({why})")

        if value is None:
            if self.optional:
                return None
            refuse("None is not allowed")
        t = self.type
        if isinstance(t, tuple) and (isinstance(value, bool) or not isinstance(value, t)):
            refuse(type(value).__name__)
        # bool is a subclass of int: True must not pass as 1, nor 1 as True; "false" is not a boolean.
        if t is bool and not isinstance(value, bool):
            refuse("write True or False, unquoted" if isinstance(value, str) else type(value).__name__)
        if t is int and (isinstance(value, bool) or not isinstance(value, int)):
            refuse(type(value).__name__)
        if t is float:
            if isinstance(value, str) and _number_text(value):
                refuse(f"text: YAML 1.1 reads a number as text unless it has a dot and a signed exponent; "
                       f"write {_yaml_float(value)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                refuse(type(value).__name__)
            if not math.isfinite(value):
                refuse("not finite")
        if t in (str, dict, list) and not isinstance(value, t):
            refuse(type(value).__name__)
        if self.choices is not None and value not in self.choices:
            refuse("not a valid choice")
        for op, bound, ok in (("ge", self.ge, lambda v, b: v >= b), ("gt", self.gt, lambda v, b: v > b),
                              ("le", self.le, lambda v, b: v <= b), ("lt", self.lt, lambda v, b: v < b)):
            if bound is not None and not ok(value, bound):
                refuse("out of range")
        return value


def _number_text(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _yaml_float(text: str) -> str:
    """A number written so that YAML 1.1 reads a float: ``1e-4`` -> ``1.0e-4``, ``1.5e3`` -> ``1.5e+3``."""
    mantissa, _, exponent = text.strip().lower().partition("e")
    mantissa = mantissa if "." in mantissa else mantissa + ".0"
    if exponent and exponent[0] not in "+-":
        exponent = "+" + exponent
    return mantissa + (f"e{exponent}" if exponent else "")


def scalar(text: str):
    """A ``key=value`` value from a label or command line: YAML, except that a number YAML 1.1 reads as a
    string (``1e-4``: no dot; ``1.5e3``: no exponent sign) is the number."""
    value = yaml.safe_load(text)
    return float(value) if isinstance(value, str) and _number_text(value) else value


def check_values(*items: tuple[str, object, Spec]) -> None:
    """``Spec.check`` each ``(name, value, spec)``: the first refusal raises."""
    for name, value, spec in items:
        spec.check(name, value)


def check_sparsity(sparsity) -> float:
    """A pruning fraction in [0, 1): MLP channels' share of the decoder parameters, or SliceGPT's
    slicing fraction. ``True`` is not 1 and ``"0.2"`` is not 0.2."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise ParameterError(f"sparsity must be a fraction in [0, 1), got {sparsity!r} (e.g. 0.2 for 20%)")
    return sparsity


def fits_context(name: str, tokens: int | None, context: int | None, model: str = "the model") -> None:
    """Refuse windows longer than the positions the model was built for (RoPE models run on silently
    with garbage; OPT's learned positions crash with an IndexError)."""
    if context and tokens and tokens > context:
        raise ParameterError(f"{option(name, tokens)} is longer than {model}'s context of {context} tokens "
                             f"(max_position_embeddings): use {option_name(name)} <= {context}")


def hp(default, **bounds):
    """A method hyperparameter: a dataclass field carrying its ``Spec`` bounds (type from the annotation)."""
    return field(default=default, metadata={"spec": bounds})


def check_fields(obj) -> None:
    """Check every field of a dataclass instance against its annotation and ``hp`` bounds."""
    hints = typing.get_type_hints(type(obj))
    where = getattr(obj, "name", type(obj).__name__)
    for f in dataclasses.fields(obj):
        spec = Spec.of(hints[f.name], **f.metadata.get("spec", {}))
        spec.check(f.name, getattr(obj, f.name), where=f"method {where!r}")


def _base_type(annotation) -> tuple[type, bool]:
    """``int`` → (int, False); ``Optional[int]`` / ``int | None`` → (int, True); ``Optional[Union[int, str]]`` →
    ((int, str), True)."""
    args = typing.get_args(annotation)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _base_type(rest[0])[0], True
        return tuple(_base_type(a)[0] for a in rest), True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(_base_type(a)[0] for a in args), False
    origin = typing.get_origin(annotation)
    return (origin or annotation), False


# Names IPython puts in every namespace; anything else that is not declared was injected by papermill.
_IPYTHON_NAMES = {"In", "Out"}
_INJECTED = (str, int, float, bool, list, dict, type(None))  # what a YAML or -p value can be


def check_notebook_parameters(namespace: dict, notebook: str) -> None:
    """Refuse undeclared parameters and values of the wrong type, in a notebook's namespace.

    Declared = the annotated names of the parameters cell (``__annotations__``). Papermill injects
    values as plain assignments after that cell, so an injected name that is not annotated is a
    parameter the notebook does not take: an error, with the closest declared name suggested.
    """
    set_surface("papermill")  # from here on, refusals name ``-p name value``
    declared = dict(namespace.get("__annotations__", {}))
    # papermill injects YAML values only: a name bound to anything else (a function, a module, the paper's settings
    # the cell imports) was not injected
    unknown = sorted(name for name, value in namespace.items()
                     if not name.startswith("_") and name not in declared and name not in _IPYTHON_NAMES
                     and isinstance(value, _INJECTED))
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, declared, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ParameterError(f"{notebook} does not take the parameter(s) {', '.join(hints)}; "
                             f"it takes {', '.join(sorted(declared))}")
    for name, annotation in declared.items():
        Spec.of(annotation).check(name, namespace[name], where=notebook)
