"""A checkpoint folder's tokenizer, checked against its config before any weight is read.

transformers finds these out late and names the wrong cause: a tokenizer.json cut short is a JSONDecodeError
that names no file, a folder with tokenizer_config.json but no vocabulary asks for sentencepiece (nothing needs
installing: the vocabulary is missing), and ids beyond the embedding's rows are an IndexError in the first forward
pass. ``check_tokenizer`` parses tokenizer.json with the parser transformers itself uses, once per version of the
file, and names the file and the fix. GGUF sources carry their tokenizer inside the file and are not checked here.
"""
from __future__ import annotations

import functools
from pathlib import Path

from spap_lib.errors import SourceError

# Files transformers rebuilds a tokenizer from when tokenizer.json is absent.
VOCABULARIES = ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
                "tokenizer.tiktoken")
SAVE = "save the model's tokenizer next to the weights with tokenizer.save_pretrained(path)"


def check_tokenizer(path: str | Path, config: dict) -> None:
    """Refuse a folder whose tokenizer cannot be read, or whose token ids reach past the model's vocabulary
    (``vocab_size`` of ``config``, the folder's config.json)."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        if (path / "tokenizer_config.json").is_file() and not any((path / f).is_file() for f in VOCABULARIES):
            raise SourceError(f"{path} has tokenizer_config.json but no tokenizer.json (nor a vocabulary such as "
                              f"tokenizer.model or vocab.json): the tokenizer's vocabulary is missing; {SAVE}")
        return
    stat = file.stat()
    largest = _largest_id(str(file), stat.st_size, stat.st_mtime_ns)
    vocab = _vocab_size(config)
    if vocab is not None and largest >= vocab:
        raise SourceError(f"{file} makes token ids up to {largest}, but config.json gives the model a vocabulary of "
                          f"{vocab} (vocab_size), ids 0 to {vocab - 1}: the tokenizer is not this model's; use the "
                          f"tokenizer saved with these weights ({SAVE})")


@functools.lru_cache(maxsize=8)
def _largest_id(file: str, size: int, mtime_ns: int) -> int:
    """The largest id that text can produce: the vocabulary, added tokens that match text, and the special tokens
    the tokenizer inserts itself (a special token it never inserts is not matched in text). Keyed by size and time:
    a file rewritten is parsed again, the same file once (``check_run`` and ``load`` both resolve the model)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as err:  # noqa: BLE001 - the parser's own message says where the text breaks
        raise SourceError(f"{file} is not a readable tokenizer ({err}): the file is damaged or was cut short; "
                          f"{SAVE}, or copy the file again") from None
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    ids = [i for i in tokenizer.get_vocab(with_added_tokens=True).values() if i not in special]
    return max([*ids, *tokenizer.encode("").ids], default=-1)


def _vocab_size(config: dict) -> int | None:
    """The embedding's rows as config.json gives them (at the top, or in the text model's part)."""
    for part in (config, config.get("text_config")):
        value = part.get("vocab_size") if isinstance(part, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
