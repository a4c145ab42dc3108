"""spap: structured pruning of LLM MLP channels via alternating optimization and penalty methods.

Hu & Yuan, "SPAP: Structured Pruning via Alternating Optimization and Penalty Methods", 2025.
"""
from spap_lib.api import prune
from spap_lib.artifact.caches import dense_perplexity, get_calibration, save_calibration
from spap_lib.artifact.checkpoint import prune_result, save
from spap_lib.checks import check_notebook_parameters
from spap_lib.errors import CheckpointError, NumericalError, OutputError, ParameterError, SourceError, SpapError
from spap_lib.evaluation.data import calibration_windows, data_dir, wikitext
from spap_lib.evaluation.perplexity import perplexity, perplexity_of_ids
from spap_lib.files import REPO, write_json_atomic
from spap_lib.methods import METHODS, get_method
from spap_lib.model.adapters import MLP, get_adapter, supported_model_types
from spap_lib.model.loading import load, resolve
from spap_lib.model.sources import OFFLINE_DEFAULT, known_models
from spap_lib.pipeline.sequential import RunSettings, prune_model
from spap_lib.pipeline.sparsity import plan_sparsity
from spap_lib.validate import check_run

__version__ = "0.1.0"
__all__ = [
    "MLP", "METHODS", "OFFLINE_DEFAULT", "REPO", "RunSettings", "CheckpointError", "NumericalError", "OutputError",
    "ParameterError", "SourceError", "SpapError", "calibration_windows", "check_notebook_parameters", "check_run",
    "data_dir", "dense_perplexity", "get_adapter", "get_calibration", "get_method", "known_models", "load",
    "perplexity", "perplexity_of_ids", "plan_sparsity", "prune", "prune_model", "prune_result",
    "resolve", "save", "save_calibration", "supported_model_types", "wikitext", "write_json_atomic",
]
