"""SPAP (Hu & Yuan, 2025): the penalty method (Alg. 1) selects channels, alternating minimization updates."""
from spap_lib.methods.spap.algorithm import SPAP

__all__ = ["SPAP"]
