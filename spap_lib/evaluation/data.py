"""WikiText-2 raw: calibration windows and the evaluation token stream.

Text comes from a local data directory when it holds the split (``$SPAP_DATA_DIR``, default the
repo's ``data/``; layout in ``data/README.md``), else from the dataset repo ``Salesforce/wikitext`` in the local
Hugging Face hub cache (``HF_HOME``; a cluster's shared one, read with ``HF_HUB_OFFLINE=1``), else from the hub.
Calibration wants the *train* split (as the paper); without it, it falls back to *validation* and
says so in ``source``: every result records where its calibration text came from.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spap_lib.errors import ParameterError, SourceError
from spap_lib.files import REPO

WIKITEXT = "wikitext-2-raw-v1"
HUB_DATASET = "Salesforce/wikitext"  # where the hub's ``wikitext`` lives: parquet files, one folder per config


SPLIT_FILES = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}


REPO_DATA = REPO / "data"  # the checkout's data/ (data/README.md)


def data_dir() -> Path:
    return Path(os.environ.get("SPAP_DATA_DIR", REPO_DATA)).expanduser()


def read_raw(path: Path) -> list[str]:
    """Rows of a ``wiki.*.raw`` file exactly as the HF dataset has them (blank lines → ""); a file that is not
    UTF-8 text is refused, naming where."""
    return read_raw_digest(path)[0]


def read_raw_digest(path: Path) -> tuple[list[str], str]:
    """``read_raw``'s rows and the SHA-256 of the bytes they came from: one read, so the digest a result records
    is that of the text it used, even if the file changes meanwhile."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise SourceError(f"{path} is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}, line "
                          f"{line}), as WikiText-2 raw is: the file is damaged or another file; copy it again "
                          "(data/README.md)") from None
    rows = [line if line.strip() else "" for line in text.splitlines(keepends=True)]
    return rows, hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Text:
    text: str
    split: str
    # "local:wikitext-2-raw-v1/wiki.valid.raw sha256:<16 hex>" (relative to the data directory: results name
    # the file and its content, not a machine's path) or "hub:Salesforce/wikitext/wikitext-2-raw-v1@<commit>
    # fingerprint:<hex>"
    source: str


def wikitext(split: str) -> Text:
    """One split as ``"\\n\\n".join(rows)`` (the standard LLM-pruning protocol): from the data directory where it
    holds WikiText-2 (a split it lacks is not looked for elsewhere: calibration then reads the validation split, as
    the committed results do), else from the hub cache or the hub."""
    local = data_dir() / WIKITEXT / SPLIT_FILES[split]
    if local.is_file():
        rows, digest = read_raw_digest(local)
        return Text("\n\n".join(rows), split, f"local:{WIKITEXT}/{SPLIT_FILES[split]} sha256:{digest[:16]}")
    if _holds_wikitext():  # the data directory is the source: a split it lacks is not fetched elsewhere
        raise _not_found(split)
    from datasets import load_dataset
    from huggingface_hub import is_offline_mode

    if (files := _hub_cached(split)) is not None:  # the hub's files, read by datasets as the hub's loader reads them
        rows = load_dataset("parquet", data_files={split: [str(f) for f in files]}, split=split)
        commit = files[0].parent.parent.name
    elif not is_offline_mode():
        try:
            rows, commit = load_dataset(HUB_DATASET, WIKITEXT, split=split), "main"
        except (ConnectionError, OSError) as err:
            raise _not_found(split, cause=f"the hub: {err}") from err
    else:
        raise _not_found(split)
    return Text("\n\n".join(rows["text"]), split,
                f"hub:{HUB_DATASET}/{WIKITEXT}@{commit[:12]} fingerprint:{rows._fingerprint}")


def _hub_cached(split: str) -> list[Path] | None:
    """The split's parquet files in the local hub cache (huggingface_hub's look-up, no network), or None."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(HUB_DATASET, repo_type="dataset", allow_patterns=[f"{WIKITEXT}/*"],
                                        local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache
        return None
    return sorted((folder / WIKITEXT).glob(f"{split}-*.parquet")) or None


def _not_found(*splits: str, cause: str = "") -> FileNotFoundError:
    from huggingface_hub import constants

    files = " or ".join(f"{WIKITEXT}/{SPLIT_FILES[s]}" for s in splits)
    if _holds_wikitext():
        return FileNotFoundError(f"WikiText-2 {' or '.join(splits)} split not found: the data directory "
                                 f"{data_dir() / WIKITEXT} holds other splits but not {files}, and a run reads its "
                                 "text from one place: add the file there (data/README.md), or point SPAP_DATA_DIR "
                                 "at a directory that holds it")
    hub = cause or ("the hub (not tried: HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "the hub")
    return FileNotFoundError(
        f"WikiText-2 {' or '.join(splits)} split not found: looked for "
        f"{' and '.join(str(data_dir() / WIKITEXT / SPLIT_FILES[s]) for s in splits)}, the dataset repo "
        f"{HUB_DATASET} in the hub cache {constants.HF_HUB_CACHE} and {hub}. Set SPAP_DATA_DIR to a directory "
        f"holding {files} (see data/README.md), e.g. SPAP_DATA_DIR=../shared/data, or HF_HOME to a hub cache "
        f"holding {HUB_DATASET}."
    )


def check_available(calibration: bool, evaluation: bool) -> None:
    """Before any model is read: the text a run will read is in the data directory or the hub cache, or the hub
    may be asked (not offline), for calibration the train split, else the validation split; for evaluation the
    test split."""
    from huggingface_hub import is_offline_mode

    needs = [("train", "validation")] * calibration + [("test",)] * evaluation
    for splits in needs:
        local = next((p for s in splits if (p := data_dir() / WIKITEXT / SPLIT_FILES[s]).is_file()), None)
        if local is not None:
            read_raw(local)  # readable text, before the model is read
            continue
        if _holds_wikitext() or (is_offline_mode() and not any(_hub_cached(s) for s in splits)):
            raise _not_found(*splits)


def _holds_wikitext() -> bool:
    """The data directory holds WikiText-2 (any split): it is then the one source of the text."""
    return any((data_dir() / WIKITEXT / f).is_file() for f in SPLIT_FILES.values())


def calibration_text() -> Text:
    """The train split if available, otherwise the validation split (recorded in ``split``)."""
    try:
        return wikitext("train")
    except FileNotFoundError:
        return wikitext("validation")


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one ``[T]`` id tensor (tokenized once; long-input warnings are moot)."""
    return tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]


@dataclass
class Calibration:
    windows: torch.Tensor  # [nsamples, seqlen]
    starts: torch.Tensor  # [nsamples] token offset of each window in the corpus
    split: str
    source: str
    corpus_tokens: int
    seed: int

    def describe(self) -> dict:
        n, seqlen = self.windows.shape
        return {"nsamples": n, "seqlen": seqlen, "tokens": n * seqlen, "split": self.split,
                "source": self.source, "corpus_tokens": self.corpus_tokens, "seed": self.seed,
                "sha256": hashlib.sha256(self.windows.contiguous().numpy().tobytes()).hexdigest()[:16]}


def calibration_windows(tokenizer, nsamples: int, seqlen: int, seed: int = 0, text: Text | None = None) -> Calibration:
    """``nsamples`` random windows of ``seqlen`` tokens (SparseGPT/Wanda protocol), seeded."""
    from spap_lib.checks import Spec

    Spec(int, ge=1).check("nsamples", nsamples)
    Spec(int, ge=2).check("seqlen", seqlen)
    Spec(int, ge=0).check("seed", seed)
    text = text or calibration_text()
    ids = tokenize(tokenizer, text.text)
    if ids.numel() < nsamples * seqlen + 1:
        raise ParameterError(
            f"too few calibration tokens: {nsamples} x {seqlen} = {nsamples * seqlen} requested but the "
            f"{text.split} split ({text.source}) has {ids.numel()} tokens. Lower nsamples or seqlen, or "
            f"provide the train split ({WIKITEXT}/{SPLIT_FILES['train']} in SPAP_DATA_DIR)."
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen, (nsamples,), generator=gen)
    windows = torch.stack([ids[s:s + seqlen] for s in starts.tolist()])
    return Calibration(windows, starts, text.split, text.source, ids.numel(), seed)
