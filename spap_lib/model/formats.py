"""Saved layouts that stock ``from_pretrained`` cannot read, as a registry: the one hook through which a method
that reshapes the whole model (not its MLP channels) reaches loading, saving and profiling.

A method whose checkpoints need one registers a ``CheckpointFormat``; loading, ``checkpoint.save`` and the
profile then name no method: they find the format by its ``config.json`` marker or by its plan's key in a
prune report.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class CheckpointFormat:
    """A saved layout, marked by a field of its ``config.json``."""
    marker: str  # the config.json field that marks it
    describe: str  # for errors: "a <describe>"
    load: Callable[[str | Path, torch.dtype], torch.nn.Module]
    read_config: Callable[[dict], object] | None = None  # None: AutoConfig reads it as usual
    resident_only: bool = False  # offload "cpu"/"disk" cannot build it
    checks_own_shapes: bool = False  # its loader is strict; only the files' readability is checked up front
    # A format whose prune report carries its own plan (not ``kept_channels``): the report's key for it, the
    # method that writes it, how a saved config.json is marked with it, how a dense base model takes its shapes
    # (a profile's variant), and the base architecture a marked config.json names.
    plan_key: str | None = None
    method: str | None = None
    mark: Callable[[Path, dict], None] | None = None
    shape: Callable[[torch.nn.Module, dict], torch.nn.Module] | None = None
    base_model_type: Callable[[dict], str | None] | None = None
    summary: str = ""  # what a prune saved in this format did to the model, for its card


FORMATS: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    FORMATS[fmt.marker] = fmt
    return fmt


def format_of(config: dict) -> CheckpointFormat | None:
    """The registered format a raw ``config.json`` is saved in, or None for a stock checkpoint."""
    return next((fmt for marker, fmt in FORMATS.items() if marker in config), None)


def format_of_report(report: dict) -> CheckpointFormat | None:
    """The registered format whose plan a prune report carries, or None: the report's ``kept_channels`` are the
    plan (every MLP-channel method)."""
    return next((fmt for fmt in FORMATS.values() if fmt.plan_key is not None and fmt.plan_key in report), None)


def model_type_of(config: dict) -> str | None:
    """The architecture a raw ``config.json`` is built on: its own ``model_type``, or its format's base one."""
    fmt = format_of(config)
    if fmt is not None and fmt.base_model_type is not None:
        return fmt.base_model_type(config)
    return config.get("model_type")
