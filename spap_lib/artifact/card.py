"""The model card every saved checkpoint carries: ``README.md`` in the Hub's conventions, YAML front matter for the
Hub's index and a short body: what was done to which model, what it measured, how it was made, how to load it.

It is rendered from the checkpoint's manifest (``spap_manifest.json``) alone; its provenance (base model, license)
is fixed there when the checkpoint is saved. The card is the user's too: ``spap eval`` merges what it adds into it
(``merge``), rewriting only spap's front-matter keys and the text between spap's two markers.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from spap_lib.artifact.portable import SUPPORTED
from spap_lib.model.formats import format_of_report
from spap_lib.model.sources import HUB_ALIASES
from spap_lib.pipeline.blocks import width_note

CARD = "README.md"
# The offline models' upstream checkpoints (their GGUF files are conversions of these) and licenses.
UPSTREAM = {
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
    "gemma3-270m": ("google/gemma-3-270m-it", "gemma"),
    "qwen2.5-coder-0.5b": ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "apache-2.0"),
}
CALIBRATION_DATASET = "Salesforce/wikitext"  # WikiText-2 raw, on the Hub
# What spap rewrites of a card: the text between these markers (invisible where the Hub renders the card).
BEGIN = "<!-- spap: the text from here to the end marker is rewritten when spap records an evaluation -->"
END = "<!-- spap: end -->"


def base_model(source: dict) -> tuple[str, str | None]:
    """The Hub id (or the name as given) of the model that was pruned, and its license where it is known: the
    offline models', or a local checkpoint's own card's."""
    name = source["name"]
    if name in UPSTREAM:
        return UPSTREAM[name]
    if source["kind"] == "hub":
        return HUB_ALIASES.get(name, source["path"]), None
    return name, _license_of(Path(source["path"]) / CARD) if source["kind"] == "dir" else None


def _license_of(card: Path) -> str | None:
    try:
        text = card.read_text()
        return ModelCard(text, ignore_metadata_errors=True).data.get("license") if text.startswith("---") else None
    except (OSError, ValueError):
        return None


def command(argv: list[str], ranks: int = 1) -> str:
    """The ``spap`` command line that made a checkpoint, as the user typed it; a data-parallel run's under
    ``torchrun`` with its number of ranks, which its weights depend on (docs/distributed.md)."""
    if ranks > 1:
        return shlex.join(["torchrun", "--nproc-per-node", str(ranks), "-m", "spap_lib.cli", *argv])
    return shlex.join(["spap", *argv])


def notebook_call(notebook: str, namespace: dict) -> str:
    """The papermill call that reruns a notebook with the parameters in its ``namespace`` (its declared ones, as
    ``check_notebook_parameters`` reads them)."""
    values = {k: namespace[k] for k in namespace.get("__annotations__", {})}
    args = [f"-p {k} {shlex.quote(str(v) if isinstance(v, (str, Path)) else json.dumps(v))}" for k, v in values.items()]
    return f"papermill notebooks/{notebook}.ipynb out.ipynb " + " ".join(args)


def provenance(source: dict) -> dict:
    """What a card says of the model that was pruned, fixed in the manifest when the checkpoint is saved: the source's
    card may change or go away after."""
    base, license_ = base_model(source)
    return {"base_model": base, **({"license": license_} if license_ else {})}


def render(fields: dict) -> str:
    """The card of a checkpoint whose manifest is ``fields``."""
    known = fields.get("card") or provenance(fields["model"])  # checkpoints saved before provenance was recorded
    method = fields.get("method", "?")
    front = ModelCardData(base_model=known["base_model"], library_name="transformers", pipeline_tag="text-generation",
                          tags=list(dict.fromkeys(["pruned", "structured-pruning", "spap", method.split("/")[0]])),
                          license=known.get("license"), datasets=[CALIBRATION_DATASET])
    fmt = format_of_report(fields)  # a whole-model method's layout, else MLP channels
    removed = (fields.get("sparsity") or {}).get("mlp_channels_removed", 1) != 0 or fmt is not None
    what = fmt.summary if fmt is not None else "whole MLP channels removed (structured pruning)"
    summary = f"Pruned with spap: {what}, so the tensors are physically smaller." if removed else \
        "Run through spap's prune with nothing removed (sparsity 0): the tensors keep the source's shapes."
    lines = [f"# {known['base_model']}, {method} at {_pct(fields.get('sparsity', {}).get('requested'))}", "",
             summary, "", "| | |", "|---|---|", *_rows(fields, removed), "", *_loading(fields), *_evaluations(fields)]
    body = "\n".join(line for i, line in enumerate(lines) if line or lines[i - 1])
    return f"---\n{front.to_yaml()}\n---\n\n{BEGIN}\n{body}\n{END}\n"


def merge(existing: str, fields: dict) -> str:
    """``render(fields)`` merged into ``existing``, a card the user may have edited: spap's front-matter keys are
    updated (tags and datasets joined), the user's kept; the text between spap's markers is replaced and the rest
    kept as it is. Where the markers are gone, the body is the user's alone and is left untouched, and so is a card
    whose front matter is not YAML."""
    new = ModelCard(render(fields))
    if not existing.strip():
        return str(new)
    try:
        card = ModelCard(existing, ignore_metadata_errors=True)
    except yaml.YAMLError:  # front matter that is not YAML: the user's to fix, not spap's to replace
        return existing
    for key, value in new.data.to_dict().items():
        if key in ("tags", "datasets"):
            value = list(dict.fromkeys([*(card.data.get(key) or []), *value]))
        card.data[key] = value
    start, end = card.text.find(BEGIN), card.text.find(END)
    if 0 <= start < end:
        card.text = card.text[:start] + new.text[new.text.find(BEGIN):].rstrip("\n") + card.text[end + len(END):]
    return str(card)


def _pct(x) -> str:
    return f"{x:.0%}" if isinstance(x, (int, float)) else "?"


def _rows(f: dict, removed: bool) -> list[str]:
    sp, cal, params = f.get("sparsity", {}), f.get("calibration", {}), f.get("params", {})
    width = sp.get("mlp_width", {})
    ppl = f.get("perplexity") or {}
    parts = {k: v for k, v in (f.get("hparams") or {}).items() if k in ("select", "allocation", "update")}
    rows = {
        "method": f"`{f.get('method')}`" + (f" ({', '.join(f'{k}={v}' for k, v in parts.items())})" if parts else ""),
        "sparsity": f"requested {_pct(sp.get('requested'))} of the decoder's parameters; achieved "
                    f"{sp.get('achieved_decoder', 0):.2%} of the decoder, {sp.get('achieved_total', 0):.2%} of all"
                    + (f" ({sp['definition']})" if sp.get("definition") else ""),
        "MLP width": (f"{width.get('dense')} → {width.get('pruned')}" if removed else f"{width.get('dense')}, "
                      "unchanged") if width else None,
        "llama.cpp": _blocks(width.get("pruned")),
        "parameters": (f"{params['dense']['total']:,} → {params['pruned']['total']:,}" if removed else
                       f"{params['dense']['total']:,}, unchanged") if params else None,
        "calibration": f"WikiText-2 {cal.get('split')} ({cal.get('source')}), {cal.get('nsamples')} windows × "
                       f"{cal.get('seqlen')} tokens = {cal.get('tokens'):,} tokens, seed {cal.get('seed')}"
                       + (f", windows sha256 `{cal['sha256']}`" if cal.get("sha256") else "") if cal else None,
        "healing": _healing(f.get("heal")),
        "perplexity": _perplexity(ppl),
        "made by": f"`{f['command']}`" if f.get("command") else None,
        "spap": f"{(f.get('versions') or {}).get('spap')}, revision `{f.get('git_revision')}`, {f.get('created')}",
        "ran on": f"{(f.get('host') or {}).get('cpu')}" + (", CUDA" if "cuda_peak_mb" in f.get("memory", {}) else "")
                  + f"; offload {f.get('offload')}, precision {f.get('precision')}",
    }
    return [f"| {k} | {v} |" for k, v in rows.items() if v]


def _blocks(pruned) -> str | None:
    """What the kept widths cost in llama.cpp's block formats, where they cost anything."""
    widths = pruned if isinstance(pruned, list) else [pruned] if isinstance(pruned, int) else []
    return width_note(widths)


def _healing(h: dict | None) -> str | None:
    """What the heal (``spap_lib.heal``) trained on, how long and what learnt: kept apart from the evaluation."""
    if not h:
        return None
    data = h.get("data") or {}
    return (f"distilled from `{h.get('teacher')}` (KL divergence of the logits) on {h.get('tokens', 0):,} tokens of "
            f"{data.get('source')} ({data.get('split')} split, windows of {h.get('seqlen')}, seed {h.get('seed')}); "
            f"{h.get('train')} weights, AdamW lr {h.get('lr')}, {h.get('precision')}, {h.get('seconds', 0):.0f} s")


def _perplexity(ppl: dict) -> str | None:
    if not ppl.get("pruned"):
        return None
    p = ppl["pruned"]
    dense = f"dense {ppl['dense']['ppl']:.2f} → " if ppl.get("dense") else ""
    healed = f"before healing {ppl['unhealed']['ppl']:.2f} → healed " if ppl.get("unhealed") else ""
    return (f"WikiText-2 test, {dense}pruned {healed}{p['ppl']:.2f} ({p.get('windows')} windows of {p.get('seqlen')} "
            "tokens)")


def _loading(f: dict) -> list[str]:
    uniform = not isinstance(f.get("sparsity", {}).get("mlp_width", {}).get("pruned"), list) and \
        format_of_report(f) is None
    if uniform:
        how = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
               'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")', "```", "",
               f"Every layer keeps the same width: stock `transformers` {SUPPORTED} loads it (the config carries "
               "`rope_theta` beside `rope_parameters` for the 4.x line), and llama.cpp's "
               "`convert_hf_to_gguf.py` converts it to GGUF (`spap_lib.artifact.llamacpp.to_gguf`, then "
               "`quantize`; what it gains there: spap's docs/llamacpp.md)."]
    else:
        how = ["```python", "import spap_lib", 'loaded = spap_lib.load("path/to/this/folder")', "```", "",
               "Its layers have widths of their own (or a sliced residual stream): stock `transformers` reads one "
               "width for every layer and refuses it, and so does llama.cpp's converter."]
    return ["## How to load", "", *how, ""]


def _evaluations(f: dict) -> list[str]:
    evals = f.get("evaluations") or []
    if not evals:
        return []
    rows = [f"| {e['task']} | {e['value']:.4g} | {e.get('protocol', '')} | `{e.get('command', '')}` |" for e in evals]
    return ["## Evaluations", "", "| task | value | protocol | command |", "|---|---:|---|---|", *rows, ""]
