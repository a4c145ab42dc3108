"""SliceGPT (Ashkboos et al., ICLR 2024) in the same harness: a whole-model method (its maths: ``slicing``).

``sparsity`` is SliceGPT's: the fraction of the residual-stream ("embedding") dimension sliced away in
every block. The parameters actually removed (shortcut matrices added, the head untied from tied
embeddings) are counted from the real tensors in every report, next to it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

from spap_lib.checks import hp
from spap_lib.errors import ParameterError, option_name
from spap_lib.methods.base import Method, register
from spap_lib.methods.cost_model import Shapes, chunks_of, priced
from spap_lib.model.adapters import COUNTED_OVER


@register
@dataclass
class SliceGPT(Method):
    name = "slicegpt"
    pipeline: ClassVar[str] = "model"
    fits: ClassVar[bool] = False
    round_to: int = hp(8, ge=1)  # kept dimension rounded down to a multiple (official --round-interval)

    @classmethod
    def fixed_parts(cls) -> str:
        return ("it rotates and slices the residual stream of the whole model: there are no MLP channels to select, "
                "allocate over layers or update")

    def check_config(self, config) -> None:
        from spap_lib.methods.slicegpt.slicing import layout_of

        layout_of(SimpleNamespace(config=config))  # an architecture it cannot rotate is refused before any work

    def check_settings(self, *, round_to: int | None, propagate: bool | None, resume_dir) -> None:
        given = [option_name(k) for k, v in (("round_to", round_to), ("propagate", propagate)) if v is not None]
        if given:
            raise ParameterError(f"method {self.name!r} does not take {', '.join(given)} (it prunes the whole model "
                                 "at once; its kept dimension's multiple is its own hyperparameter round_to)")
        super().check_settings(round_to=round_to, propagate=propagate, resume_dir=resume_dir)  # not resumable

    def prune_model(self, loaded, calib, sparsity: float, *, batch_size: int, progress: bool) -> dict:
        from spap_lib.methods.slicegpt.slicing import SLICED_FORMAT, fuse_norms, plan_of, rotate_and_slice, sliced_dim

        t0 = time.perf_counter()
        model = loaded.model
        k = sliced_dim(model.config.hidden_size, sparsity, self.round_to)
        layout = fuse_norms(model)
        dims = rotate_and_slice(model, layout, calib.windows, k, batch_size=batch_size, device=loaded.device)
        d = model.config.hidden_size
        return {"seconds": time.perf_counter() - t0, "layers": dims, "precision": "float64",
                "plan": {SLICED_FORMAT.plan_key: plan_of(model, layout, dims)},
                "sparsity": {"definition": f"{self.name}: fraction of the residual-stream dimension sliced "
                                           f"({d} -> {k})",
                             "counted_over": COUNTED_OVER.replace("norms", "norms, shortcut matrices")}}


def _cost(m: SliceGPT, s: Shapes) -> dict[str, dict[str, float]]:
    """Per block three float64 PCA Gram sums (d x d) and eigendecompositions (~9 d³, counted at the solve rate)."""
    return {"PCA (float64 Gram sums, eigh)": {"solve": 3 * (2 * s.N * s.d * s.d + 9 * s.d**3),
                                              "steps": 3 * (chunks_of(s.N, s.chunk) + 1)}}


def _working_set(m: SliceGPT, s: Shapes) -> dict[str, float]:
    """The head untied from tied embeddings, the float64 PCA Gram and one chunk."""
    return {**({"untied head copy": s.vocab * s.d * s.weight_bytes} if s.tied else {}),
            "PCA Gram (float64)": 2 * s.d * s.d * 8 + min(s.chunk, s.N) * s.d * 8}


priced(SliceGPT, cost=_cost, working_set=_working_set)
