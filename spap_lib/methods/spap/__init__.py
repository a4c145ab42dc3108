"""SPAP (Hu & Yuan, 2025): the penalty method (Alg. 1) selects channels, alternating minimization updates.

Importing the package registers its presets, its two parts (``penalty``, the rounds of ``alternating``) and the
compositions' pricing (``cost``).
"""
from spap_lib.methods.spap import cost  # noqa: F401  (registers the compositions' pricing)
from spap_lib.methods.spap.algorithm import SPAP

__all__ = ["SPAP"]
