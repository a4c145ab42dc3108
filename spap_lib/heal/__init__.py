"""Healing: a short distillation of the pruned model from the dense one, after the prune (docs/heal.md).

``heal(student, teacher, cfg)`` trains the pruned model in place and returns what it did (the manifest's and the
model card's ``heal``). It trains the whole model on one device (``offload="none"``): ``spap plan`` prices its
memory (the weights, their gradients and AdamW's state, the teacher, a batch's activations and logits) and a run
that does not fit is refused with the plan before any weight is read.
"""
from __future__ import annotations

from pathlib import Path

from spap_lib.errors import ParameterError
from spap_lib.heal import distill as kd
from spap_lib.heal.data import HealWindows, check_heal_data, heal_text, heal_windows
from spap_lib.heal.state import clear as clear_state
from spap_lib.heal.state import weights_digest
from spap_lib.keys import source_key, tokenizer_digest
from spap_lib.model.loading import Loaded
from spap_lib.settings import HealConfig

__all__ = ["HealConfig", "HealWindows", "check_heal_data", "clear_state", "heal", "heal_text", "heal_windows"]


def heal(student: Loaded, teacher: Loaded, cfg: HealConfig, *, resume_dir: Path | None = None,
         progress: bool = True) -> dict:
    """Distil ``teacher`` (the dense model) into ``student`` (pruned, in place) over ``cfg.tokens`` tokens."""
    if student.offload != "none" or teacher.offload != "none":
        raise ParameterError("healing trains the whole model on the device: load the pruned and the dense model "
                             "with offload='none' (spap plan says whether they fit)")
    if tokenizer_digest(student.tokenizer) != tokenizer_digest(teacher.tokenizer):
        raise ParameterError(f"the teacher {teacher.source.name} splits text into other ids than the pruned model: "
                             "heal from the dense model the checkpoint was pruned from")
    windows = heal_windows(student.tokenizer, heal_text(cfg.data), cfg.seqlen, cfg.seed)
    # the student's weights are hashed only for a resume point, which must continue a heal of these weights
    fingerprint = {"student": weights_digest(student.model) if resume_dir is not None else None,
                   "teacher": source_key(teacher.source)}
    teacher.model.eval().requires_grad_(False)
    report = kd.distill(student, teacher.model, windows, cfg, resume_dir=resume_dir, fingerprint=fingerprint,
                     progress=progress)
    return {**report, "teacher": teacher.source.name, "teacher_key": fingerprint["teacher"]}
