"""Zero-shot accuracy with lm-eval on the paper's six tasks, online or from the data directory.

Offline, each task runs from a generated config that ``include``s lm-eval's own stock config (same
prompt, target, choices and metrics as the paper's numbers) and only swaps the dataset for the local
JSON lines in ``$SPAP_DATA_DIR/<task>/`` (already in the Hugging Face field layout, see each
SOURCE.md). With no local copy the stock task reads the hub. The in-memory model is evaluated
directly (``HFLM(pretrained=model, tokenizer=tokenizer)``): no checkpoint round trip.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from spap_lib.errors import ParameterError, SourceError
from spap_lib.evaluation.data import data_dir


@dataclass(frozen=True)
class Task:
    stock: str  # lm-eval's config, relative to lm_eval/tasks
    split: str  # the split the stock config evaluates
    file: str  # local file holding that split, in $SPAP_DATA_DIR/<task>/


TASKS: dict[str, Task] = {
    "arc_easy": Task("arc/arc_easy.yaml", "test", "test.jsonl"),
    "arc_challenge": Task("arc/arc_challenge.yaml", "test", "test.jsonl"),
    "piqa": Task("piqa/piqa.yaml", "validation", "validation.jsonl"),
    "openbookqa": Task("openbookqa/openbookqa.yaml", "test", "test.jsonl"),
    "winogrande": Task("winogrande/default.yaml", "validation", "dev.jsonl"),
    "rte": Task("glue/rte/default.yaml", "validation", "validation.jsonl"),
}
# The metric each task contributes to the Table-3 mean: length-normalised accuracy where lm-eval
# defines it for the task's multiple-choice format and the paper family (FLAP, LLM-Pruner, SliceGPT)
# reports it (ARC-c, OpenBookQA), plain accuracy elsewhere. Both are in the long table.
SUMMARY_METRIC = {"arc_easy": "acc", "arc_challenge": "acc_norm", "piqa": "acc", "openbookqa": "acc_norm",
                  "winogrande": "acc", "rte": "acc"}
LOCAL_PREFIX = "spap_local_"


def _stock_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def check_tasks(tasks: list[str]) -> None:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ParameterError(f"unknown task(s) {unknown}: spap knows {', '.join(TASKS)}")


def local_configs(tasks: list[str], out_dir: str | Path, root: Path | None = None, hub: bool = False) -> dict[str, str]:
    """Write one config per task whose data is in ``root`` (default ``$SPAP_DATA_DIR``).

    Returns {task: name to pass to lm-eval}. A task without local files runs the stock (hub) task
    when ``hub`` is allowed; otherwise a clear error names the directory it looked in.
    """
    check_tasks(tasks)
    root = Path(root) if root else data_dir()
    out_dir = Path(out_dir)
    names = {}
    for name in tasks:
        task = TASKS[name]
        local = root / name / task.file
        if not local.is_file():
            if hub:
                names[name] = name
                continue
            raise FileNotFoundError(
                f"task {name!r}: {local} not found and the hub is not used. Put the {task.split} split there "
                f"as JSON lines in the Hugging Face field layout (see ../shared/data/{name}/SOURCE.md), set "
                f"SPAP_DATA_DIR to a directory that has it, or allow the hub (hub=True)."
            )
        config = {
            "include": str(_stock_dir() / task.stock),
            "task": LOCAL_PREFIX + name,
            "tag": [],
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {task.split: str(local.resolve())}},
            "training_split": None,
            "validation_split": task.split if task.split == "validation" else None,
            "test_split": task.split if task.split == "test" else None,
        }
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        names[name] = LOCAL_PREFIX + name
    return names


def fingerprint(model, sample: int = 4096) -> str:
    """A short hash of a model's weights: every tensor's name, shape and dtype and a strided sample of
    ``sample`` of its values. It names the model's lm-eval request cache, so cached answers are only
    ever reused by the same weights (a pruned model differs in shapes, a refit one in values), at a
    cost independent of the model's size."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(flat[:: max(1, flat.numel() // sample)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def evaluate(model, tokenizer, tasks: list[str], limit: int | None = None, batch_size: int = 1,
             hub: bool = False, seed: int = 0, cache_dir: str | Path | None = None) -> list[dict]:
    """Tidy rows ``{task, metric, value, stderr, n, source}`` for every metric lm-eval reports.

    ``cache_dir``: keep every answered request in ``<cache_dir>/<fingerprint>_rank0.db`` (lm-eval's
    request cache, committed request by request), so an interrupted evaluation of the same weights
    resumes where it stopped; None: no cache.
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if tokenizer is None:
        raise SourceError("zero-shot evaluation needs the model's tokenizer (the checkpoint has none)")
    with tempfile.TemporaryDirectory(prefix="spap_tasks_") as tmp:
        names = local_configs(tasks, tmp, hub=hub)
        manager = TaskManager(include_path=tmp)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = simple_evaluate(model=lm, tasks=list(names.values()), task_manager=manager, limit=limit,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed, log_samples=False,
                              use_cache=str(Path(cache_dir) / fingerprint(model)) if cache_dir else None)
    rows = []
    for task, name in names.items():
        res = out["results"][name]
        n = out.get("n-samples", {}).get(name, {}).get("effective")
        for key, value in res.items():
            metric, _, filt = key.partition(",")
            if metric in ("acc", "acc_norm"):
                stderr = res.get(f"{metric}_stderr,{filt}")  # "N/A" when lm-eval cannot compute one
                rows.append({"task": task, "metric": metric, "value": float(value),
                             "stderr": float(stderr) if isinstance(stderr, (int, float)) else float("nan"),
                             "n": n, "source": "local" if name.startswith(LOCAL_PREFIX) else "hub"})
    return rows


def score(loaded, eval_seqlens: list[int], eval_windows: int | None, tasks: list[str], **options) -> list[dict]:
    """Table 3's rows for one loaded model: WikiText-2 perplexity at each of ``eval_seqlens`` (first
    ``eval_windows`` test windows; None: all), then zero-shot accuracy on ``tasks`` (``options``: ``evaluate``'s
    keywords, ``limit``, ``batch_size``, ``hub``, ``seed``, ``cache_dir``)."""
    from spap_lib.evaluation.perplexity import perplexity

    rows = []
    for s in eval_seqlens:
        ppl = perplexity(loaded.model, loaded.tokenizer, s, eval_windows)
        rows.append({"task": "wikitext2", "metric": f"ppl@{s}", "value": ppl["ppl"], "stderr": float("nan"),
                     "n": ppl["windows"], "source": ppl["source"]})
    return rows + evaluate(loaded.model, loaded.tokenizer, tasks, **options)


def table3(table, stderr: bool = False):
    """The paper's Table 3 layout from tidy rows: perplexities, then per-task accuracy (%, the task's
    ``SUMMARY_METRIC``) and their mean, one row per (model, method, sparsity, limit).

    ``limit`` is part of the key: the same checkpoint scored on 100 examples per task and on the whole
    splits gives two rows, never an average of both. With ``stderr`` the accuracies are strings
    "acc ± stderr" (lm-eval's standard error, in points); the mean's is that of a mean of six independent
    estimates, sqrt(sum stderr²) / 6.
    """
    import numpy as np
    import pandas as pd

    index = ["model", "method", "sparsity"] + (["limit"] if "limit" in table.columns else [])
    zs = table[table["task"].isin(list(TASKS))]
    picked = zs[[SUMMARY_METRIC[t] == m for t, m in zip(zs["task"], zs["metric"])]]
    tasks = [t for t in TASKS if t in set(picked["task"])]
    acc = picked.pivot_table(index=index, columns="task", values="value")[tasks] * 100
    acc["mean"] = acc.mean(axis=1)
    if stderr:
        se = picked.pivot_table(index=index, columns="task", values="stderr")
        se = se.reindex(index=acc.index, columns=tasks) * 100
        se["mean"] = np.sqrt((se**2).sum(axis=1, min_count=len(tasks))) / len(tasks)
        acc = acc.combine(se, lambda a, e: pd.Series(
            [f"{x:.2f}" if np.isnan(y) else f"{x:.2f} ± {y:.2f}" for x, y in zip(a, e)], index=a.index))
    else:
        acc = acc.round(2)
    ppl = table[table["task"] == "wikitext2"].pivot_table(index=index, columns="metric", values="value").round(2)
    return ppl.join(acc, how="outer") if len(ppl) else acc
