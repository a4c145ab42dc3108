"""The text a pruned model heals on: non-overlapping windows in a seeded order, never the evaluation's test split.

The default is the calibration's text (``evaluation.data.calibration_text``: WikiText-2 train where the data
directory, the hub cache or the hub has it, else validation); a user names another UTF-8 file. Step ``k`` takes
windows ``k·batch … (k+1)·batch`` of an endless sequence of permutations (epoch ``e`` shuffled with seed
``seed + e``), so any step's windows are known without replaying the ones before: a resumed heal reads exactly
the windows the uninterrupted one would.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spap_lib.errors import ParameterError
from spap_lib.evaluation.data import (
    SPLIT_FILES,
    WIKITEXT,
    Text,
    calibration_text,
    check_available,
    data_dir,
    read_raw_digest,
    tokenize,
)
from spap_lib.keys import sha256_of


@dataclass(frozen=True)
class HealWindows:
    windows: torch.Tensor  # [n, seqlen]: the text cut in order, the last partial window dropped
    split: str
    source: str
    seed: int

    def batch(self, step: int, size: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The windows of optimizer step ``step`` (``rows``: this rank's share ``[start, stop)`` of them)."""
        n = self.windows.shape[0]
        picks = []
        for i in range(step * size, (step + 1) * size):
            epoch, at = divmod(i, n)
            picks.append(int(self._order(epoch)[at]))
        start, stop = rows or (0, size)
        return self.windows[picks[start:stop]]

    def _order(self, epoch: int) -> torch.Tensor:
        cache = self.__dict__.setdefault("_orders", {})  # frozen: a memo, not state
        if epoch not in cache:
            cache.clear()
            cache[epoch] = torch.randperm(self.windows.shape[0], generator=torch.Generator().manual_seed(
                self.seed + epoch))
        return cache[epoch]

    def describe(self) -> dict:
        n, seqlen = self.windows.shape
        return {"split": self.split, "source": self.source, "windows": n, "seqlen": seqlen, "tokens": n * seqlen,
                "seed": self.seed}


def check_heal_data(path: str | None) -> Path | None:
    """Before any weight is read: the named file exists and is not the evaluation's test split; for the default,
    that the calibration's text is there (``check_available``). Returns the named file."""
    if path is None:
        check_available(calibration=True, evaluation=False)
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        raise ParameterError(f"heal data {path} is not a file: name a UTF-8 text file, or leave it unset for "
                             "WikiText-2 (train, else validation)")
    test = data_dir() / WIKITEXT / SPLIT_FILES["test"]
    if file.name == SPLIT_FILES["test"] or (test.is_file() and test.stat().st_size == file.stat().st_size
                                            and sha256_of(test) == sha256_of(file)):
        raise ParameterError(f"heal data {path} is WikiText-2's test split, which the perplexity is measured on: "
                             "heal on another text (the default is the train split, else validation)")
    return file


def heal_text(path: str | None) -> Text:
    """The named file (refused if it is the evaluation's test split), else the calibration's text."""
    if path is None:
        return calibration_text()  # its own error names where it looked
    file = check_heal_data(path)
    rows, digest = read_raw_digest(file)
    return Text("".join(rows), "file", f"file:{file.name} sha256:{digest[:16]}")


def heal_windows(tokenizer, text: Text, seqlen: int, seed: int) -> HealWindows:
    """``text`` tokenized once and cut into windows of ``seqlen``; refused if it holds not even one."""
    ids = tokenize(tokenizer, text.text)
    n = ids.numel() // seqlen
    if n < 1:
        raise ParameterError(f"heal data ({text.source}) holds {ids.numel()} tokens, fewer than one window of "
                             f"{seqlen}: give a longer text or a shorter heal seqlen")
    return HealWindows(ids[:n * seqlen].view(n, seqlen), text.split, text.source, seed)
