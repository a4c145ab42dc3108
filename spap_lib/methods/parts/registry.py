"""One kind of registry for the three parts: each entry names itself and declares what it needs.

The pipeline and the methods ask an entry's ``needs`` instead of testing its name, so a new selection,
allocation or update is one registered entry (``docs/architecture.md``: extending it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spap_lib.checks import ParameterError

# What a part may need from the pipeline (``Part.needs``), and what each means.
NEEDS = {
    "dense_pass": "a dense pass over the calibration windows before the first layer is pruned",
    "channel_stats": "that pass measures every channel (ChannelStats.of), not only each block's angular distance",
    "channel_mean": "each channel's mean over tokens, which a Gram diagonal does not hold",
    "scores": "every layer's channel scores on dense statistics (Method.allocation_scores)",
    "curves": "every layer's error curve (Method.error_curve) in that pass",
    "refit": "the kept channels' output projection refitted by least squares",
    "rounds": "rounds of Adam steps on the dense targets Y, token by token (the update's hyperparameters)",
    "closed_form": "each round ends in a closed-form solve of the output projection: the rounds' token sample can be "
                   "resampled for it, and the best round refitted on every token",
    "solves": "it solves for the output projection itself (the penalty method's W-steps): the damping acts",
}


@dataclass(frozen=True)
class Part:
    """A registered part. ``settings``: the dataclass of hyperparameters a composition must carry to use it (the
    penalty method's, the update rounds'); its fields act only while the part is chosen, and its ``inert(method)``,
    where it has one, names those that the chosen part's other settings make inert."""

    name: str
    needs: frozenset[str] = field(default_factory=frozenset)
    settings: type | None = None

    def __post_init__(self) -> None:
        unknown = set(self.needs) - set(NEEDS)
        if unknown:
            raise ValueError(f"{type(self).__name__} {self.name!r} needs {sorted(unknown)}: not one of {sorted(NEEDS)}")


class Registry(dict):
    """``name -> Part``. It is also the ``choices`` of a method's part hyperparameter, so an entry registered
    later is a valid choice at once."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, part: Part) -> Part:
        if part.name in self:
            raise ValueError(f"{self.kind} {part.name!r} is registered twice")
        self[part.name] = part
        return part

    def __missing__(self, name: str):
        raise ParameterError(f"unknown {self.kind} {name!r}: one of {', '.join(self)}")
