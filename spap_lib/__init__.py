"""spap: structured pruning of LLM MLP channels via alternating optimization and penalty methods.

Hu & Yuan, "SPAP: Structured Pruning via Alternating Optimization and Penalty Methods", 2025.
"""
from .adapters import MLP, get_adapter, supported_model_types
from .api import prune
from .caches import dense_perplexity, get_calibration, save_calibration
from .checkpoint import prune_result, save
from .checks import check_notebook_parameters
from .data import calibration_windows, data_dir, wikitext
from .errors import CheckpointError, NumericalError, OutputError, ParameterError, SourceError, SpapError
from .evaluate import perplexity, perplexity_of_ids
from .io import REPO, write_json_atomic
from .methods import METHODS, get_method
from .models import OFFLINE_DEFAULT, known_models, load, resolve
from .pipeline import plan_sparsity, prune_model
from .validate import check_run

__version__ = "0.1.0"
__all__ = [
    "MLP", "METHODS", "OFFLINE_DEFAULT", "REPO", "CheckpointError", "NumericalError", "OutputError",
    "ParameterError", "SourceError", "SpapError", "calibration_windows", "check_notebook_parameters", "check_run",
    "data_dir", "dense_perplexity", "get_adapter", "get_calibration", "get_method", "known_models", "load",
    "perplexity", "perplexity_of_ids", "plan_sparsity", "prune", "prune_model", "prune_result",
    "resolve", "save", "save_calibration", "supported_model_types", "wikitext", "write_json_atomic",
]
