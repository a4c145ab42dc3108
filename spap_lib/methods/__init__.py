"""Pruning methods, all registered under one interface (``Method.prune(LayerProblem)``).

Every module of this package is imported here, and importing a module registers the methods it
decorates with ``@register``: a new method is one new file, nothing else to edit.
"""
import importlib
import pkgutil

from spap_lib.methods.base import (
    METHODS,
    LayerProblem,
    Method,
    PruneResult,
    Unsupported,
    get_method,
    parse_label,
    register,
)
from spap_lib.settings import PAPER

DEFAULT_METHOD = PAPER.method  # the paper's method: what a prune uses unless told otherwise

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["DEFAULT_METHOD", "METHODS", "LayerProblem", "Method", "PruneResult", "Unsupported", "get_method",
           "parse_label", "register"]
