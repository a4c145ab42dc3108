"""Pruning methods, all registered under one interface (``Method.prune(LayerProblem)``)."""
from .base import METHODS, LayerProblem, Method, PruneResult, get_method, gram, register
from . import spap  # noqa: F401  (registers "spap")

__all__ = ["METHODS", "LayerProblem", "Method", "PruneResult", "get_method", "gram", "register"]
