"""A saved checkpoint that every supported ``transformers`` loads to the same model.

transformers 5 writes RoPE only as ``rope_parameters`` and names its tokenizer class ``TokenizersBackend``; the 4.x
line (``SUPPORTED``'s oldest) reads ``rope_theta``, ``rope_scaling`` and Gemma-3's ``rope_local_base_freq``, and
falls back to a base of 10,000 where ``rope_theta`` is missing: a wrong model, with no error. ``portable`` writes
those fields beside ``rope_parameters``, with the same values, and a tokenizer class both lines instantiate
(docs/reproduce.md: Engines and versions).
"""
from __future__ import annotations

import json
from pathlib import Path

from spap_lib.errors import CheckpointError
from spap_lib.files import write_json_atomic

SUPPORTED = ">=4.56"  # the transformers versions a saved checkpoint loads in; pyproject.toml says the same
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # transformers 5's TokenizersBackend under the name 4.x has


def legacy_rope(rope: dict) -> dict:
    """The 4.x config fields that say what ``rope_parameters`` says: one set for every layer, or Gemma-3's
    ``full_attention`` set (``rope_theta``, ``rope_scaling``) and its sliding layers' base
    (``rope_local_base_freq``, which 4.x runs unscaled)."""
    per_type = "full_attention" in rope
    full = rope["full_attention"] if per_type else rope
    fields = {"rope_theta": full["rope_theta"]}
    if full.get("rope_type", "default") != "default":
        fields["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    if per_type and "sliding_attention" in rope:
        sliding = rope["sliding_attention"]
        if sliding.get("rope_type", "default") != "default":
            raise CheckpointError(f"the sliding layers' RoPE is {sliding['rope_type']!r}: transformers 4.x runs them "
                                  "unscaled and would load another model; this checkpoint cannot be written for it")
        fields["rope_local_base_freq"] = sliding["rope_theta"]
    return fields


def make_portable(folder: str | Path) -> None:
    """Add the fields older transformers read to ``folder``'s config.json and tokenizer_config.json."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    for cfg in (config, config.get("text_config")):
        if cfg and cfg.get("rope_parameters"):
            cfg.update(legacy_rope(cfg["rope_parameters"]))
    write_json_atomic(folder / "config.json", config)
    tok = folder / "tokenizer_config.json"
    if tok.is_file():
        fields = json.loads(tok.read_text())
        if fields.get("tokenizer_class") == "TokenizersBackend":
            write_json_atomic(tok, {**fields, "tokenizer_class": TOKENIZER_CLASS})
