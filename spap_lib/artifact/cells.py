"""What a cell of the ablation grid is, and whether a row of the table is still a current result of it.

A cell is a ``Variant`` (a method and its hyperparameters) at a sparsity, scored under the grid's ``Protocols``.
A row is current while the hyperparameters that decide its result (``Method.effective_hparams``) are the ones it
recorded: a default changed since makes it stale, and the cell runs again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd

from spap_lib.artifact.table import ABLATION
from spap_lib.errors import ParameterError
from spap_lib.methods import get_method, parse_label

# Columns that identify a cell: a row with the same values is not recomputed.
KEY = list(ABLATION.key)


@dataclass(frozen=True)
class Variant:
    """A registered method with hyperparameters; ``label`` names it in tables and figures.

    Labels are ``method`` or ``method/key=value,key=value`` (e.g. ``flap/allocation=uniform``).
    """

    label: str
    method: str
    hparams: dict

    @classmethod
    def parse(cls, label: str, base: dict | None = None) -> "Variant":
        method, given = parse_label(label)
        hparams = {**(base or {}).get(method, {}), **given}
        get_method(method, **hparams)  # unknown method or hyperparameter: fail before any work
        return cls(label, method, hparams)


@dataclass(frozen=True)
class Eval:
    """An extra perplexity protocol for the cells whose label is in ``labels`` (all when empty) and whose
    sparsity is in ``sparsities`` (all when empty; ``dense`` matches by label alone)."""

    seqlen: int
    windows: int | None = None  # None: the whole test split
    labels: tuple[str, ...] = ()
    sparsities: tuple[float, ...] = ()

    @classmethod
    def parse(cls, spec: dict, labels: list[str] | None = None, sparsities: list[float] | None = None) -> "Eval":
        """``spec`` from a config; with ``labels`` / ``sparsities`` (the grid's), the ones it names must be
        among them (a typo would silently match no cell)."""
        unknown = set(spec) - {"seqlen", "windows", "labels", "sparsities"}
        if unknown or "seqlen" not in spec:
            raise ParameterError(f"bad extra evaluation {spec!r}: expected keys seqlen, windows (null: whole split), "
                             f"labels, sparsities")
        from spap_lib.checks import Spec

        Spec(int, ge=2).check("extra_evals seqlen", spec["seqlen"])
        Spec(int, ge=1, optional=True).check("extra_evals windows", spec.get("windows"))
        stray = set(spec.get("labels") or ()) - {"dense", *(labels or ())}
        if labels is not None and stray:
            raise ParameterError(f"extra evaluation {spec!r} names {sorted(stray)}, which the grid does not run "
                             f"(its labels: dense, {', '.join(labels)}): add them to methods, or give extra_evals "
                             "without them (a file that narrows methods, -f cells.yaml, sets extra_evals: [])")
        odd = [x for x in spec.get("sparsities") or () if sparsities is not None
               and not any(abs(float(x) - y) < 1e-9 for y in sparsities)]
        if odd:
            raise ParameterError(f"extra evaluation {spec!r} names sparsities {odd} that the grid does not run "
                             f"(its sparsities: {sparsities})")
        return cls(spec["seqlen"], spec.get("windows"), tuple(spec.get("labels") or ()),
                   tuple(float(x) for x in spec.get("sparsities") or ()))

    def applies(self, label: str, sparsity: float) -> bool:
        if self.labels and label not in self.labels:
            return False
        return label == "dense" or not self.sparsities or any(abs(sparsity - s) < 1e-9 for s in self.sparsities)


@dataclass(frozen=True)
class Protocols:
    """The perplexity protocols of a grid: each of ``seqlens`` on the first ``windows`` test windows (None: the
    whole split), plus the ``extra`` evaluations that apply to a cell."""

    seqlens: tuple[int, ...]
    windows: int | None
    extra: tuple[Eval, ...] = ()

    def of(self, label: str, sparsity: float) -> list[tuple[int, int | None]]:
        protocols = [(s, self.windows) for s in self.seqlens]
        protocols += [(e.seqlen, e.windows) for e in self.extra if e.applies(label, sparsity)]
        return list(dict.fromkeys(protocols))


DENSE = Variant("dense", "dense", {})


def resolved(method: str, hparams: dict) -> str:
    """Every hyperparameter the cell ran with, defaults included (``hparams`` holds the overrides only): a
    row stays exact when a default changes later, and the grid can tell that it is stale."""
    return "{}" if method == "dense" else json.dumps(get_method(method, **hparams).hparams(), sort_keys=True)


def effective(method: str, hparams: dict) -> dict:
    """The hyperparameters that decide the cell's result (``Method.effective_hparams``)."""
    return {} if method == "dense" else get_method(method, **hparams).effective_hparams()


def before(method: str) -> dict:
    """What a row of ``method`` recorded before an option of ``Method.introduced`` existed ran with: its
    default (such options were added with the earlier behaviour as their default)."""
    if method == "dense":
        return {}
    algo = get_method(method)
    defaults = algo.hparams()
    return {k: defaults[k] for k in algo.introduced if k in defaults}


def ran_with(recorded: str, effective: dict, absent: dict | None = None) -> bool:
    """A row ran with ``effective``: each of them recorded with the same value (keys the row records
    beyond them are inert now), or not recorded and ``absent`` (``before``) says what it ran. Rows written
    before the column existed record nothing and count."""
    if not recorded:
        return True
    ran = {**(absent or {}), **json.loads(recorded)}
    return all(k in ran and ran[k] == v for k, v in effective.items())


def same_tokenizer(table: pd.DataFrame, digest: str, rebuilt: bool) -> pd.Series:
    """The rows whose ids came from the tokenizer of ``digest`` (``keys.tokenizer_digest``): those recording it, and
    those recorded before the column existed where spap still tokenizes as transformers builds the tokenizer
    (``rebuilt`` False: ``gguf_tokenizer.rebuilt``)."""
    if "tokenizer" not in table:
        return pd.Series(not rebuilt, index=table.index)
    recorded = table["tokenizer"].fillna("").astype(str)
    return (recorded == digest) | ((recorded == "") & (not rebuilt))


def done(table: pd.DataFrame, row: dict, method: str, current: dict,
         tokenizer: tuple[str, bool] | None = None) -> bool:
    """A row of ``row``'s cell and protocol ran with the ``current`` effective hyperparameters: the row of
    ``row``'s key, or another label's row of the same method that recorded the same settings (``spap/lr=0.01``
    once 1e-2 is the default). A row whose recorded settings differ (a default changed since), or whose ids came
    from another ``tokenizer`` (digest, rebuilt: ``same_tokenizer``), is stale: the cell runs again and replaces it."""
    if table.empty:
        return False
    cell = pd.Series(True, index=table.index) if tokenizer is None else same_tokenizer(table, *tokenizer)
    for k in KEY:
        if k not in ("label", "hparams"):
            cell &= table[k].astype(str) == str(row[k])
    same_key = cell & (table["label"].astype(str) == row["label"]) & (table["hparams"].astype(str) == row["hparams"])
    if "resolved_hparams" not in table:
        return bool(same_key.any())
    recorded = table["resolved_hparams"].fillna("").astype(str)
    absent = before(method)
    ran_these = recorded.map(lambda r: ran_with(r, current, absent))
    same_settings = cell & (table["method"].astype(str) == method) & (recorded != "") & ran_these
    return bool((same_key & ran_these).any() or same_settings.any())
