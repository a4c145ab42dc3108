"""What a run leaves behind and where it may leave it: manifests, checkpoint folders, the out_dir policy.

* ``manifest``: versions, git revision, host, CPU and the run's own fields, written beside every output.
* ``check_out_dir``: a checkpoint directory is written only where it is new, empty, or holds a
  previous spap checkpoint (with ``overwrite``); never over a foreign directory, the source model
  or the run folder. Checked before any work and again just before the swap.
* ``save_pruned``: model, tokenizer, manifest and extra files into one directory, installed atomically.
"""
from __future__ import annotations

import json
import os
import platform
import secrets
import subprocess
import time
from importlib import metadata
from pathlib import Path

from spap_lib.artifact.portable import make_portable
from spap_lib.errors import CheckpointError, OutputError, option, option_name
from spap_lib.files import REPO, atomic_dir, clean_leftovers, write_json_atomic, write_text_atomic
from spap_lib.keys import folder_digests, tokenizer_digest

MANIFEST = "spap_manifest.json"


PLAN = "spap_plan.json"


CHECKPOINT_FORMAT = 1


def read_checkpoint_manifest(path: str | os.PathLike) -> dict | None:
    """The manifest of a spap checkpoint directory, or None if ``path`` is not one."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    if "spap_checkpoint" in manifest:
        return manifest
    # Checkpoints written before the format marker: spap's version and a method in the manifest.
    legacy = isinstance(manifest.get("versions"), dict) and "spap" in manifest["versions"] and "method" in manifest
    return manifest if legacy else None


def _writable(directory: Path) -> None:
    """Create and remove a probe entry: the only test that also holds for read-only mounts."""
    probe = directory / f".spap-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as err:
        raise OutputError(f"cannot write in {directory} ({err.strerror}): choose {option_name('out_dir')} in a "
                          "writable directory") from None


def check_out_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                  protect: dict[str, str | os.PathLike] | None = None) -> str:
    """Refuse, before any work, an ``out_dir`` that spap may not (re)write; say why and what to do.

    Allowed: a path that does not exist, an empty directory, or (``overwrite=True``) a previous spap
    checkpoint holding only the files its manifest lists. ``protect`` maps a description to a path
    that must survive (the source model, the run folder): ``out_dir`` may be neither it nor an
    ancestor of it. Returns ``"new"``, ``"empty"`` or ``"checkpoint"``.
    """
    if not isinstance(overwrite, bool):
        raise OutputError(f"overwrite must be True or False, got {overwrite!r}")
    name = option_name("out_dir")  # --out on the command line
    if not str(out_dir).strip() or Path(out_dir).name in ("", ".", ".."):
        raise OutputError(f"{name} {str(out_dir)!r} names no new folder (the checkpoint is written beside it and "
                          f"moved into place): give a folder name, e.g. {option('out_dir', 'pruned')}")
    out = Path(os.path.normpath(Path(out_dir).expanduser().absolute()))  # as files._prepare will write it
    real = out.resolve()
    for what, keep in (protect or {}).items():
        keep = Path(keep).expanduser().resolve()
        if real == keep or real in keep.parents:
            raise OutputError(f"{name} {out} would replace {what} ({keep}): choose another {name}")
    if out.parent.is_dir():
        clean_leftovers(out)  # an interrupted earlier run: restore or remove what it left
    state = "new"
    if os.path.lexists(out):
        if not out.is_dir():
            raise OutputError(f"{name} {out} exists and is not a directory: choose another {name}")
        names = sorted(p.name for p in out.iterdir())
        state = "empty"
        if names:
            manifest = read_checkpoint_manifest(out)
            if manifest is None:
                shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                raise OutputError(f"{name} {out} is not empty and is not a spap checkpoint (it holds {shown}): "
                                  f"spap never replaces a directory it did not write. Choose a new or empty {name}.")
            listed = manifest.get("spap_checkpoint", {}).get("files")
            extra = sorted(set(names) - set(listed)) if listed is not None else []
            if extra:
                raise OutputError(f"{name} {out} holds a spap checkpoint and files spap did not write "
                                  f"({', '.join(extra[:5])}): move them away or choose another {name}")
            if not overwrite:
                what = f"{manifest.get('method', '?')} at sparsity {manifest.get('sparsity', {}).get('requested', '?')}"
                raise OutputError(f"{name} {out} holds a previous spap checkpoint "
                                  f"({what}, {manifest.get('created', '')}): "
                                  f"pass {option('overwrite')} to replace it, or choose another {name}")
            state = "checkpoint"
            _writable(out)  # its old files are removed after the swap
    parent = out.parent
    while not parent.exists():  # parents are created on save; the first existing one must be writable
        parent = parent.parent
    _writable(parent)
    return state


# -- manifests ----------------------------------------------------------------------------------


# What runs write into the checkout (tables, figures, benchmark records): a grid that has written its first row
# still runs the committed code, so these leave the revision clean.
OUTPUTS = ("results", "figures", "bench/results")


def git_revision() -> str | None:
    """HEAD, with ``+dirty`` where a tracked file other than the outputs differs from it."""
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--", ".",
                                *(f":(exclude){p}" for p in OUTPUTS)],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("spap", "torch", "transformers", "datasets", "gguf", "lm_eval", "papermill"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def cpu_name() -> str:
    """The processor's model name: a CPU's kernels (bf16 products, above all) differ between processors, and so do
    the last digits of a CPU run's results (docs/results/budgets.md: ``make main``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device) -> str:
    """What a measurement ran on, for a benchmark's header: the GPU's name, or the CPU's with its threads."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def manifest(**fields) -> dict:
    """Versions, git revision, host and time, plus whatever the run adds (parameters, seed, …); the host's CPU with
    the kernels its bf16 products run on (``bf16.kernels``)."""
    import torch

    from spap_lib.numerics import bf16

    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_revision": git_revision(),
        "versions": versions(),
        "host": {"machine": platform.machine(), "cpu": cpu_name(), "cuda": torch.cuda.is_available(),
                 "threads": torch.get_num_threads(), "bf16_products": bf16.kernels("cpu")},
        **fields,
    }


def write_manifest(path: str | os.PathLike, **fields) -> None:
    """``manifest(**fields)`` written atomically to ``path``: what a notebook leaves beside its table."""
    write_json_atomic(path, manifest(**fields))


def save_pruned(write, tokenizer, out_dir: str | os.PathLike, manifest_fields: dict,
                extra_files: dict[str, object] | None = None, *, overwrite: bool = False,
                protect: dict | None = None, check=None) -> Path:
    """The weights (``write(tmp)``: ``save_pretrained`` in safetensors, or an offloaded model's own shards) +
    tokenizer + JSON files + manifest, installed atomically.

    ``check(tmp) -> dict`` runs on the finished scratch copy before it is installed (the reload
    check), and so does ``check_saved_tokenizer``: if either raises, ``out_dir`` is left exactly as it was. Their
    results are stored in the manifest under ``checks``. Stock-loadable.
    """
    check_out_dir(out_dir, overwrite=overwrite, protect=protect)
    with atomic_dir(out_dir, records=True) as tmp:
        write(tmp)
        tokenizer.save_pretrained(tmp)
        make_portable(tmp)  # the fields older transformers read, beside the new ones
        for name, obj in (extra_files or {}).items():  # text as it is (the model card), anything else as JSON
            (write_text_atomic if isinstance(obj, str) else write_json_atomic)(tmp / name, obj)
        checks = check_saved_tokenizer(tokenizer, tmp)  # the cheaper check first
        checks.update(check(tmp) if check else {})
        files = sorted({p.name for p in tmp.iterdir()} | {MANIFEST})
        write_json_atomic(tmp / MANIFEST, {**manifest_fields, "checks": checks,
                                           "spap_checkpoint": {"format": CHECKPOINT_FORMAT, "files": files,
                                                               "digests": folder_digests(tmp, memo=False)}})
        check_out_dir(out_dir, overwrite=overwrite, protect=protect)  # unchanged while we worked?
    return Path(out_dir)


# Digits, runs of spaces, a tab and a newline: where tokenizers of one vocabulary split differently.
TOKENIZER_PROBE = "The 1990s game ,  Valkyria Chronicles III , was released in 2011 .\n = = Plot = = \n\t3.14 @-@ 42  a"


def check_saved_tokenizer(tokenizer, folder: Path) -> dict:
    """The tokenizer written to ``folder`` reloads with stock ``AutoTokenizer`` to the same ids as the one the
    model was calibrated and evaluated with, on a text where splits differ; else the checkpoint is not installed."""
    from transformers import AutoTokenizer

    want = tokenizer(TOKENIZER_PROBE).input_ids
    reloaded = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    got = reloaded(TOKENIZER_PROBE).input_ids
    if got != want:  # e.g. transformers 5 rebuilds a qwen2 checkpoint's tokenizer as Qwen2Tokenizer, whatever it was
        raise CheckpointError(
            f"the saved tokenizer does not reload to the ids the model was measured with: stock AutoTokenizer reads "
            f"it as {type(reloaded).__name__}, which gives {len(got)} ids where the {type(tokenizer).__name__} gives "
            f"{len(want)} on a probe text, so no checkpoint is saved with it. Prune with a tokenizer that "
            "transformers loads for this architecture (the model's own, as published with it)")
    return {"tokenizer": tokenizer_digest(tokenizer), "tokenizer_reloads": True}
