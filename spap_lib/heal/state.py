"""A heal's resume point: the learning weights, AdamW's and the schedule's state and the step, in one file
(``heal_state.pt`` in the run's resume folder), replaced atomically every couple of minutes.

The file records what it continues (the settings, the teacher, the text's windows, the student's weights at the
start); a file written for another heal is refused, naming what differs, rather than mixed into this one. The
data order is a function of the step (``data.HealWindows``) and no other randomness is drawn, so a resumed heal
ends with the weights of an uninterrupted one.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from spap_lib.errors import ParameterError
from spap_lib.files import atomic_file

STATE = "heal_state.pt"


def weights_digest(model: torch.nn.Module) -> str:
    """The model's weights (names, shapes and bytes), as 16 hex digits."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def load(folder: Path | None, fingerprint: dict) -> dict | None:
    """The saved state of this heal, None when there is none; refused when it was written for another."""
    path = folder and Path(folder) / STATE
    if path is None or not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a torn or foreign file: the message names it
        raise ParameterError(f"{path} is unreadable ({type(err).__name__}: {err}); delete it to heal from the "
                             "start") from None
    saved = state.get("fingerprint", {}) if isinstance(state, dict) else {}
    differ = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
    if differ:
        shown = "; ".join(f"{k}: {saved.get(k)!r} there, {fingerprint.get(k)!r} now" for k in differ[:4])
        raise ParameterError(f"{path} continues another heal ({shown}): give another resume folder, or delete "
                             f"{path} to heal from the start")
    return state


def save(folder: Path | None, state: dict) -> None:
    if folder is None:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    with atomic_file(Path(folder) / STATE) as tmp:
        torch.save(state, tmp)


def clear(folder: Path | None) -> None:
    if folder is not None and (path := Path(folder) / STATE).is_file():
        path.unlink()
