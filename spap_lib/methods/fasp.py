"""FASP (Hu et al., 2025, arXiv:2501.09412): Wanda-style column score + least-squares restoration.

Per MLP: score output-projection columns by FASP's pruning metric ``S_j = Σ_i |W_ij|·‖Z_j‖₂`` (the
Wanda metric summed over a column), remove the lowest together with the matching input-projection
rows, then apply FASP's restoration step: the kept columns refitted in closed form,
``W_K = Y Z_Kᵀ (Z_K Z_Kᵀ + δI)⁻¹``, from the Gram matrix. Layers are pruned in sequence on the
activations of the already pruned ones, like SPAP (whose t = 0 score is exactly this metric).

A preset of the layer-wise composition (``methods.parts``): ``select="wanda"``, ``update="ls"``.
"""
from __future__ import annotations

from dataclasses import dataclass

from spap_lib.checks import hp
from spap_lib.methods.base import register
from spap_lib.methods.parts.composition import Composition
from spap_lib.methods.parts.selection import SELECTIONS, UPDATES


@register
@dataclass
class FASP(Composition):
    name = "fasp"
    select: str = hp("wanda", choices=SELECTIONS)
    update: str = hp("ls", choices=UPDATES)
