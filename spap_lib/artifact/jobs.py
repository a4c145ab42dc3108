"""The ablation grid's cells as jobs of a scheduler, through submitit: SLURM on a cluster, local processes on one
machine (docs/distributed.md: The grid as jobs).

A first job prepares what every cell shares and leaves it in the run folder: the calibration windows
(``caches.get_calibration``), the dense reference's rows, and every dense pass the variants read (``Grid`` with a
``shared`` folder; each file keyed and checked when read back). Then every (variant, sparsity) cell is a job of
its own, at most ``workers`` at a time. A cell adds its rows under the table's lock (``table.add_rows``), so
concurrent cells keep each other's; a cell whose job fails is submitted again, up to ``retries`` times, and
resumes at the next layer its checkpoints hold (``Grid.resume_dir``: the same folder in every attempt).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from spap_lib.artifact.cells import Protocols, Variant
from spap_lib.artifact.grid import Grid, _slug, run_cell, run_dense
from spap_lib.artifact.table import ABLATION, read
from spap_lib.errors import ParameterError, SpapError
from spap_lib.pipeline.sequential import RunSettings

CLUSTERS = ("local", "slurm", "debug")  # submitit's executors: processes here, SLURM jobs, in this process


@dataclass(frozen=True)
class GridJobs:
    """One model's grid, as every job receives it (plain data: it is pickled into each job)."""

    model: str
    variants: tuple[Variant, ...]
    sparsities: tuple[float, ...]
    protocols: Protocols
    results_csv: str
    run_dir: str
    calibration: tuple[int, int, int]  # nsamples, seqlen, seed
    device: str = "auto"
    threads: int | None = None  # torch threads per job; None: torch's default

    def cells(self) -> list[tuple[str, float]]:
        return [(v.label, s) for s in self.sparsities for v in self.variants]

    def shared(self) -> Path:
        return Path(self.run_dir) / "shared" / _slug(self.model)

    def open(self, slot: int = 0) -> Grid:
        """The grid in this process: the model, the shared windows, layer checkpoints under ``run_dir/progress``."""
        import torch

        from spap_lib.artifact.caches import get_calibration
        from spap_lib.model.loading import load

        if self.threads:
            torch.set_num_threads(self.threads)
        device = self.device
        if device in ("auto", "cuda") and torch.cuda.device_count() > 1:  # local workers: one GPU each
            device = f"cuda:{slot % torch.cuda.device_count()}"
        loaded = load(self.model, device=device)
        nsamples, seqlen, seed = self.calibration
        calib = get_calibration(loaded, nsamples, seqlen, seed, cache=self.shared() / "calibration.pt")
        return Grid(self.model, loaded, calib, RunSettings(seed=seed, progress=False),
                    resume_root=Path(self.run_dir) / "progress", shared=self.shared())

    def prepare(self) -> None:
        """The first job: the windows, the dense rows and every dense pass, for the cells to read."""
        grid = self.open()
        run_dense(grid, self.protocols, self.results_csv)
        for v in self.variants:
            grid.pass_for(v)

    def cell(self, label: str, sparsity: float, slot: int = 0) -> None:
        variant = next(v for v in self.variants if v.label == label)
        run_cell(self.open(slot), variant, sparsity, self.protocols, self.results_csv)


# What submitit's local and debug executors read (they ignore any other name, so a typo is refused here).
LOCAL_PARAMETERS = {"timeout_min", "gpus_per_node", "visible_gpus", "tasks_per_node", "nodes", "signal_delay_s",
                    "stderr_to_stdout", "setup"}


def executor(cluster: str, folder: str | Path, parameters: dict | None = None):
    """A submitit executor for ``cluster`` writing its job files and logs under ``folder``; ``parameters`` are the
    executor's own (``timeout_min``, ``gpus_per_node``; for SLURM ``partition``, ``time``, …), checked before any
    job starts."""
    import submitit

    if cluster not in CLUSTERS:
        raise ParameterError(f"cluster {cluster!r}: give one of {', '.join(CLUSTERS)}")
    parameters = dict(parameters or {})
    stray = set(parameters) - LOCAL_PARAMETERS if cluster != "slurm" else set()
    if stray:
        raise ParameterError(f"cluster_parameters {sorted(stray)}: submitit's {cluster} executor reads only "
                             f"{', '.join(sorted(LOCAL_PARAMETERS))}")
    kind = {"local": submitit.LocalExecutor, "slurm": submitit.SlurmExecutor, "debug": submitit.DebugExecutor}[cluster]
    try:
        ex = kind(folder=str(folder))
        # a day unless told: submitit's local default (minutes) would kill a SPAP cell mid-layer
        ex.update_parameters(**({"time": 24 * 60} if cluster == "slurm" else {"timeout_min": 24 * 60}), **parameters)
    except (RuntimeError, ValueError, TypeError) as err:  # no srun here; an sbatch option submitit does not know
        raise ParameterError(f"cluster {cluster!r} with {parameters}: {str(err).splitlines()[0]}") from None
    return ex


def check_jobs(cluster: str, parameters: dict, workers: int, resume: bool, folder: str | Path):
    """What ``03_ablate`` is asked for when it dispatches cells (``workers`` > 0), before any model loads: the
    executor; jobs always skip the cells already in the table, so ``resume`` must hold."""
    if not resume:
        raise ParameterError("workers > 0 with resume=False: jobs skip the cells the table holds; delete their rows "
                             "(or give another results_csv) to run them again, or set workers to 0")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ParameterError(f"workers {workers!r}: give the number of jobs at a time (>= 1), or 0 for one process")
    return executor(cluster, folder, parameters)


def run_as_jobs(jobs: GridJobs, ex, workers: int) -> pd.DataFrame:
    """The grid on executor ``ex``; local CPU jobs share the cores (torch's default gives every job all of them)."""
    if isinstance(ex, _local_kinds()) and jobs.threads is None:
        jobs = replace(jobs, threads=max(1, (os.cpu_count() or 1) // workers))
    return dispatch(jobs, ex, workers)


def _local_kinds() -> tuple:
    import submitit

    return submitit.LocalExecutor, submitit.DebugExecutor


def _failure(job) -> BaseException | None:
    try:
        return job.exception()
    except Exception as err:  # noqa: BLE001 - a job killed before it wrote a result: its absence is the failure
        return err


def dispatch(jobs: GridJobs, ex, workers: int = 2, retries: int = 1, poll_s: float = 1.0) -> pd.DataFrame:
    """Run ``jobs`` on the executor ``ex``: the preparation, then the cells, ``workers`` at a time; the table."""
    if workers < 1 or retries < 0:
        raise ParameterError(f"workers {workers} and retries {retries}: give workers >= 1 and retries >= 0")
    read(jobs.results_csv, ABLATION)  # a damaged table: refused before any job starts
    _run(jobs, ex, [None], workers, retries, poll_s)  # None: the preparation
    _run(jobs, ex, jobs.cells(), workers, retries, poll_s)
    return read(jobs.results_csv, ABLATION)


def _run(jobs: GridJobs, ex, cells: list, workers: int, retries: int, poll_s: float) -> None:
    """Every cell as a job, at most ``workers`` at once; a failed one again while it has attempts left."""
    queue, running, failed, tries = list(cells), [], [], dict.fromkeys(cells, 0)
    while queue or running:
        while queue and len(running) < workers:
            cell = queue.pop(0)
            tries[cell] += 1
            slot = min(set(range(workers)) - {s for _, _, s in running})  # a local worker's GPU
            job = ex.submit(jobs.prepare) if cell is None else ex.submit(jobs.cell, *cell, slot)
            running.append((job, cell, slot))
        time.sleep(poll_s)
        for entry in [r for r in running if r[0].done()]:
            running.remove(entry)
            job, cell, _ = entry
            err = _failure(job)
            if err is not None and tries[cell] <= retries:
                print(f"{jobs.model} {cell or 'preparation'}: job {job.job_id} failed ({type(err).__name__}); "
                      f"submitted again, from its finished layers", flush=True)
                queue.append(cell)
            elif err is not None:
                failed.append((cell, job, err))
    if failed:
        lines = "; ".join(f"{c or 'preparation'} (job {j.job_id}: {_last_line(e)})" for c, j, e in failed)
        raise SpapError(f"{len(failed)} job(s) of the {jobs.model} grid failed after {retries + 1} attempt(s): "
                        f"{lines}. Their logs are in {ex.folder}; running the grid again resumes them")


def _last_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:160]
