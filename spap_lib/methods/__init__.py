"""Pruning methods, all registered under one interface (``Method.prune(LayerProblem)``)."""
from .base import METHODS, LayerProblem, Method, PruneResult, Unsupported, get_method, gram, register
from . import fasp, scores, spap  # noqa: F401  (importing registers the methods)

__all__ = ["METHODS", "LayerProblem", "Method", "PruneResult", "Unsupported", "get_method", "gram", "register"]
