"""A prune's settings, one home for ``spap prune``, notebook 02 and Python (``spap_lib.run``): the defaults are
the paper's, which 02's parameter cell repeats as literals for papermill (``tests/test_settings.py`` holds them
equal); the command line's defaults are read from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PruneSettings:
    """What a prune is asked for; the defaults are the paper's (notebook 02's parameter cell and ``spap prune``)."""

    model: str
    method: str = "spap"
    sparsity: float = 0.2
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    device: str = "auto"
    offload: str = "auto"
    save_dtype: str = "auto"
    hparams: dict = field(default_factory=dict)
    propagate: bool | None = None
    round_to: int | str | None = None
    eval_seqlen: int = 2048
    eval_windows: int | None = None  # None: the whole test split
    evaluate: bool = True  # the dense and pruned perplexity
