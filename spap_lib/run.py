"""One prune, written once: the steps that ``spap prune`` and ``notebooks/02_prune.ipynb`` both take, in order.

check (every setting, before any weight is read) → load → calibrate and measure the dense model → prune → round
the weights to the saved dtype and measure the pruned model → heal (``heal_tokens``: distilled from the dense model,
rounded and measured again) → save (installed only if it reloads to the same
logits) → the result. ``spap prune`` adds the data-parallel ranks (each step agrees or waits where it must; one
process skips both) and a resume folder; 02 adds its run folder's caches. A defect in this sequence now lives in
one place.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import spap_lib as sl  # each step through the package's names, which tests replace to see what ran
from spap_lib.evaluation.data import Calibration
from spap_lib.model.dtypes import RunDtypes, pick_dtype, run_dtypes
from spap_lib.model.loading import Loaded, pick_device
from spap_lib.numerics.collective import barrier, world
from spap_lib.pipeline import distributed
from spap_lib.plan import HealPlan
from spap_lib.settings import HealConfig, RunConfig
from spap_lib.validate import RunCheck


@dataclass
class PruneRun:
    """A prune's state between its steps. ``run_dir``: 02's folder (calibration and dense-perplexity caches, and
    protected from ``out_dir``); ``resume_dir``: finished layers kept until the checkpoint is installed."""

    settings: RunConfig
    out_dir: Path
    overwrite: bool = False
    run_dir: Path | None = None
    resume_dir: Path | None = None
    job: RunCheck | None = None
    dtypes: RunDtypes | None = None
    loaded: Loaded | None = None
    calibration: Calibration | None = None
    report: dict = field(default_factory=dict)

    def check(self) -> str:
        """Every setting, the model's config, the plan and ``out_dir``, before any weight is read; returns the
        summary to print (what will run, the plan, the dtypes)."""
        s = self.settings
        evals = {"eval_seqlen": s.eval_seqlen, "eval_windows": s.eval_windows} if s.evaluate else {}
        heal = HealConfig.of(s)
        if heal.tokens and heal.data is not None:  # the default text is the calibration's, checked with it
            from spap_lib.heal import check_heal_data

            check_heal_data(heal.data)  # a missing file, or the test split, before anything else
        self.job = sl.check_run(
            s.model, method=s.method, sparsity=s.sparsity, hparams=s.hparams, nsamples=s.nsamples, seqlen=s.seqlen,
            seed=s.seed, round_to=s.round_to, propagate=s.propagate, device=s.device, out_dir=self.out_dir,
            run_dir=self.run_dir, overwrite=self.overwrite, offload=s.offload, spill_dir=self._spill(),
            resume_dir=self.resume_dir, heal=heal if heal.tokens else None, **evals)
        self.dtypes = run_dtypes(s.save_dtype, self.job.source, self.job.config,
                                 pick_dtype("auto", pick_device(s.device)))  # a CPU computes in float32
        return self.job.summary() + "\n" + self.dtypes.note()

    def load(self) -> Loaded:
        """The model, on the device or one decoder layer at a time (offload cpu/disk)."""
        if self.run_dir is not None:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        self.loaded = sl.load(self.settings.model, device=self.settings.device, offload=self.job.offload,
                              spill_dir=self._spill())
        return self.loaded

    def calibrate(self):
        """The calibration windows (every rank the same ones) and the dense perplexity; 02's run folder caches
        both."""
        s, cache = self.settings, self.run_dir
        self.calibration = sl.get_calibration(self.loaded, s.nsamples, s.seqlen, s.seed,
                                              cache=cache and cache / "calibration.pt")
        distributed.agree("calibration", self.calibration.describe())  # each rank takes its share of the same
        dense = sl.dense_perplexity(self.loaded, s.eval_seqlen, s.eval_windows,
                                    cache=cache and cache / "dense.json") if s.evaluate else None
        self.report["perplexity"] = {"dense": dense} if s.evaluate else {}
        return self.calibration

    def prune(self) -> dict:
        """The prune, then the weights rounded to the saved dtype: the pruned perplexity is the checkpoint's."""
        s, ppl = self.settings, self.report.get("perplexity", {})
        self.report = sl.prune(self.loaded, self.calibration, s.method, s.sparsity, hparams=s.hparams, seed=s.seed,
                               propagate=s.propagate, round_to=s.round_to, resume_dir=self.resume_dir,
                               clear_resume=False)  # the finished layers are kept until the checkpoint is installed
        self.loaded.onloader.round_weights(self.dtypes.saved)
        if s.evaluate:
            ppl["pruned"] = sl.perplexity(self.loaded.model, self.loaded.tokenizer, s.eval_seqlen, s.eval_windows,
                                          onloader=self.loaded.onloader)
        self.report.update(perplexity=ppl, dtype=self.dtypes.as_dict(),  # save writes the weights in "saved"
                           plan=self.job.memory_time.as_dict() if self.job.memory_time else None)
        return self.report

    def heal(self) -> dict | None:
        """With ``heal_tokens``: the pruned model distilled from the dense one (``healed``)."""
        if not self.settings.heal_tokens:
            return None
        return healed(self.loaded, self.settings.model, self.report, self.settings, self.resume_dir,
                      self.dtypes.saved)

    def save(self, command: str) -> dict | None:
        """Install the checkpoint (rank 0, once every rank has finished its layers), free the model and the
        resume folder; the result as 02's ``prune_result.json`` holds it (None on the other ranks)."""
        barrier()
        rank = world().rank
        if rank == 0:
            sl.save(self.loaded, self.report, self.out_dir, overwrite=self.overwrite, command=command,
                    protect={"the run folder": self.run_dir} if self.run_dir else None)
        self.loaded.onloader.close()  # offload="disk": the spill folder goes (the checkpoint holds the layers)
        if self.resume_dir is not None and rank == 0:  # installed: a kill before here resumes after the last layer
            from spap_lib.pipeline.resume import clear_folder

            clear_folder(self.resume_dir)
        barrier()  # a rank ends only once the checkpoint is installed
        if rank > 0:
            return None
        s = self.settings
        heal = {"heal": _heal_summary(self.report["heal"])} if "heal" in self.report else {}
        return {**sl.prune_result(s.model, s.method, s.sparsity, self.out_dir, self.report),
                "dtype": self.report["dtype"], **heal}

    def agreed(self) -> dict:
        """What every rank of a data-parallel prune must have been given alike."""
        from spap_lib.keys import source_key

        given = {k: v for k, v in asdict(self.settings).items() if k != "device"}  # cuda:<rank> on each rank
        return {**given, "model": source_key(self.job.source), "offload": self.job.offload,
                "out": os.path.abspath(self.out_dir),  # one folder, whether given relative or absolute
                "resume_dir": self.resume_dir and os.path.abspath(self.resume_dir)}

    def _spill(self) -> Path:
        """Where an offloaded model's spill folder goes: the run folder, else beside ``out_dir``."""
        return self.run_dir or Path(self.out_dir).expanduser().parent


def healed(loaded: Loaded, teacher: str, report: dict, s: RunConfig, resume_dir: Path | None, saved) -> dict:
    """The heal step of both runs: ``loaded`` distilled from ``teacher`` (``spap_lib.heal``), rounded to the saved
    dtype and measured again, the perplexity before it kept in ``report`` as ``unhealed``; returns the heal's record
    (``report["heal"]``)."""
    from spap_lib.heal import heal

    dense = sl.load(teacher, device=s.device)
    report["heal"] = heal(loaded, dense, HealConfig.of(s), resume_dir=resume_dir, progress=world().rank == 0)
    del dense
    loaded.onloader.round_weights(saved)
    ppl = report.get("perplexity") or {}
    if s.evaluate:
        ppl = {**ppl, "unhealed": ppl.get("pruned"), "pruned": sl.perplexity(
            loaded.model, loaded.tokenizer, s.eval_seqlen, s.eval_windows, onloader=loaded.onloader)}
    report["perplexity"] = ppl
    return report["heal"]


@dataclass
class HealRun:
    """``spap heal CHECKPOINT --teacher SOURCE --out DIR``: a checkpoint pruned before, distilled from the dense
    model it was pruned from, then saved with its prune's record and the heal's (the steps ``PruneRun.heal`` takes
    after a prune). ``settings.model`` is the pruned checkpoint."""

    settings: RunConfig
    teacher: str
    out_dir: Path
    overwrite: bool = False
    resume_dir: Path | None = None
    plan: HealPlan | None = None  # once checked

    def check(self) -> tuple[HealConfig, dict]:
        """The heal's settings, its text, the checkpoint's record, the folders and its plan (``plan.plan_heal``: the
        memory on this device, refused where it does not fit), before any weight is read."""
        from spap_lib.artifact.checkpoint import prune_record
        from spap_lib.errors import ParameterError
        from spap_lib.heal import check_heal_data
        from spap_lib.plan import local_device, plan_heal

        s = self.settings
        cfg = HealConfig.of(s)
        if not cfg.tokens:
            raise ParameterError("heal_tokens is 0: give the heal a budget, e.g. --heal-tokens 262144")
        report = prune_record(s.model)
        if report is None:
            raise ParameterError(f"{s.model} is not a spap checkpoint (no spap_manifest.json): heal the folder a "
                                 "prune wrote, or prune with --heal-tokens")
        check_heal_data(cfg.data)
        sl.resolve(self.teacher)
        evals = {"eval_seqlen": s.eval_seqlen, "eval_windows": s.eval_windows} if s.evaluate else {}
        sl.check_run(s.model, device=s.device, offload="none", out_dir=self.out_dir, overwrite=self.overwrite,
                     **evals)
        row, memory = local_device(pick_device(s.device))
        self.plan = plan_heal(s.model, self.teacher, cfg, row, memory)
        if not self.plan.fits:
            raise ParameterError(f"{self.plan.table()}\nthe heal does not fit in this device's {memory:.1f} GB: train "
                                 "fewer weights (--heal '{\"train\": \"lora\"}' or \"mlp\": less gradient and AdamW "
                                 "state), a smaller heal batch or seqlen, or a device with more memory")
        return cfg, report

    def run(self, command: str) -> dict:
        """Load both models, heal, round to the checkpoint's dtype, measure, save; the result as ``spap prune``'s."""
        from spap_lib.heal import clear_state
        from spap_lib.model.dtypes import saved_dtype

        s = self.settings
        _, report = self.check()
        print(self.plan.table(), flush=True)
        student = sl.load(s.model, device=s.device)
        healed(student, self.teacher, report, s, self.resume_dir, saved_dtype(report) or student.model.dtype)
        sl.save(student, report, self.out_dir, overwrite=self.overwrite, command=command, healed_from=s.model)
        clear_state(self.resume_dir)
        return {**sl.prune_result(s.model, report.get("method"), (report.get("sparsity") or {}).get("requested"),
                                  self.out_dir, report), "heal": _heal_summary(report["heal"])}


def _heal_summary(heal: dict) -> dict:
    """The heal's lines of a run's printed result (its whole record is in the manifest)."""
    return {k: heal[k] for k in ("tokens", "steps", "train", "lr", "precision", "seconds", "tokens_per_s")} | {
        "loss": {k: heal["loss"][k] for k in ("first", "last")}, "data": heal["data"]["source"]}
