"""llama.cpp's token ids of the WikiText-2 test text for each offline GGUF model: the reference spap's tokenizer is
checked against where llama.cpp is not installed (``tests/test_real_model.py``).

llama.cpp splits text with the pre-tokenizer each GGUF names (``tokenizer.ggml.pre``), as the model's own
tokenizer does; transformers' build of a GGUF's tokenizer leaves some of them out (``spap_lib.model.gguf_tokenizer``).
For each model the file records the GGUF's digest, its pre-tokenizer's name, how many ids llama.cpp gives and their
sha256, and the same for transformers' build (``transformers``) and spap's (``spap``: ``sl.load``'s tokenizer).

    make setup-engines && python bench/tokens.py      # writes tests/data/llamacpp_tokens.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
from importlib import metadata
from pathlib import Path

import spap_lib as sl
from spap_lib.files import REPO, write_json_atomic
from spap_lib.keys import file_digest
from spap_lib.model.gguf_tokenizer import gguf_string
from spap_lib.model.loading import load_tokenizer

OUT = REPO / "tests" / "data" / "llamacpp_tokens.json"
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")


def ids_digest(ids: list[int]) -> dict:
    return {"tokens": len(ids), "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}


def gguf_tokenizers(source):
    """transformers' build of a GGUF's tokenizer, and spap's (the one ``sl.load`` returns)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file,
                                         trust_remote_code=False), load_tokenizer(source)


def measure(name: str, text: str) -> dict:
    from llama_cpp import Llama

    source = sl.resolve(name)
    path = Path(source.path) / source.gguf_file
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    theirs, ours = gguf_tokenizers(source)
    return {"gguf": source.gguf_file, "gguf_sha256": file_digest(path), "pre": gguf_string(path, "tokenizer.ggml.pre"),
            "llama_cpp": ids_digest(llm.tokenize(text.encode(), add_bos=False, special=False)),
            "transformers": ids_digest(theirs(text, add_special_tokens=False).input_ids),
            "spap": ids_digest(ours(text, add_special_tokens=False).input_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    text = sl.wikitext("test")
    models = {name: measure(name, text.text) for name in a.models}
    write_json_atomic(a.out, {"text": text.source, "command": "python bench/tokens.py",
                              "versions": {k: metadata.version(k) for k in ("llama_cpp_python", "transformers",
                                                                           "tokenizers")}, "models": models})
    for name, m in models.items():
        print(f"{name} ({m['pre']}): llama.cpp {m['llama_cpp']['tokens']}, transformers {m['transformers']['tokens']}"
              f", spap {m['spap']['tokens']} ids; spap == llama.cpp: {m['spap'] == m['llama_cpp']}")


if __name__ == "__main__":
    main()
