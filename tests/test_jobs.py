"""The ablation grid as scheduler jobs (submitit's local executor): the rows of the sequential grid, a killed cell
rerun from its layer checkpoints, shared state checked when read back."""
import os
import signal
import sys

import cloudpickle
import pytest
import torch

import spap_lib as sl
from spap_lib.artifact.caches import calibration_key, load_dense_pass, save_calibration
from spap_lib.artifact.cells import Protocols, Variant
from spap_lib.artifact.grid import Grid, run_grid
from spap_lib.artifact.jobs import GridJobs, dispatch, executor
from spap_lib.errors import ParameterError
from spap_lib.evaluation.data import Calibration, calibration_text
from spap_lib.pipeline.sequential import RunSettings

# The local executor's jobs unpickle this module's functions by value: they need not import the tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAST = {"spap": {"K": 3, "am_iters": 1, "adam_steps": 1, "batch_tokens": 16, "update_precision": "full"}}
KILLED = ("spap", 0.2)


def _killed_after_first_layer(fn, *args):
    """The job is SIGKILLed (no cleanup, as an out-of-memory kill or a preempted node) once its first layer is
    committed."""
    from spap_lib.pipeline.resume import LayerCheckpoint

    real = LayerCheckpoint.save

    def save(self, i, *a, **k):
        real(self, i, *a, **k)
        os.kill(os.getpid(), signal.SIGKILL)

    LayerCheckpoint.save = save
    return fn(*args)


class FirstAttemptKilled:
    """Submitit's executor, with the first job of the ``KILLED`` cell killed midway."""

    def __init__(self, inner):
        self.inner, self.folder, self.killed = inner, inner.folder, []

    def submit(self, fn, *args):
        if tuple(args[:2]) == KILLED and not self.killed:
            job = self.inner.submit(_killed_after_first_layer, fn, *args)
            self.killed.append(job)
            return job
        return self.inner.submit(fn, *args)


def _setup(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    loaded = sl.load(str(path), device="cpu")
    windows = torch.randint(1, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    calib = Calibration(windows, torch.arange(4) * 24, "validation", calibration_text().source, 10_000, 0)
    run_dir = tmp_path / "run"
    variants = tuple(Variant.parse(v, FAST) for v in ("magnitude", "spap"))  # a one-pass cell and a layer-wise one
    jobs = GridJobs(str(path), variants, (0.2,), Protocols((16,), 2), str(run_dir / "ablation.csv"), str(run_dir),
                    (4, 24, 0), device="cpu", threads=1)
    # the windows 01 would have drawn, under their key: every job reads them from the run folder
    save_calibration(jobs.shared() / "calibration.pt", calib, calibration_key(loaded, 4, 24, 0))
    return loaded, calib, jobs


def test_two_local_workers_write_the_sequential_rows_and_a_killed_cell_resumes(tiny_checkpoint, tmp_path):
    loaded, calib, jobs = _setup(tiny_checkpoint, tmp_path)
    torch.set_num_threads(1)
    alone = run_grid(Grid(jobs.model, loaded, calib, RunSettings(progress=False)), list(jobs.variants), [0.2],
                     [16], 2, tmp_path / "alone.csv")
    ex = FirstAttemptKilled(executor("local", tmp_path / "jobs"))
    table = dispatch(jobs, ex, workers=2, retries=1, poll_s=0.2)

    assert len(ex.killed) == 1
    with pytest.raises(Exception, match="(?i)job"):  # killed: it left no result
        ex.killed[0].result()
    assert len(table) == len(alone) == 3
    mine, theirs = (t.set_index(["label", "sparsity", "eval_seqlen"]).sort_index() for t in (table, alone))
    assert list(mine.index) == list(theirs.index)
    # other processes and sums at one thread: the same numbers up to float32 rounding
    assert mine["ppl"].to_numpy() == pytest.approx(theirs["ppl"].to_numpy(), rel=1e-5)
    assert (mine["mlp_channel_ratio"] == theirs["mlp_channel_ratio"]).all()
    assert mine.loc[("spap", 0.2, 16), "resumed_at_layer"] == 1  # its first layer came from the killed job
    assert (mine.drop(index=("spap", 0.2, 16))["resumed_at_layer"] == 0).all()
    assert not any((tmp_path / "run" / "progress").rglob("state.json"))  # rows written: checkpoints cleared


def test_shared_dense_passes_are_keyed_and_a_damaged_one_is_computed_again(tiny_checkpoint, tmp_path):
    _, _, jobs = _setup(tiny_checkpoint, tmp_path)
    grid = jobs.open()
    stats, seconds = grid.pass_for(jobs.variants[0])
    (stored,) = jobs.shared().glob("dense-*.pt")
    again = Grid(jobs.model, grid.loaded, grid.calib, RunSettings(progress=False), shared=jobs.shared())
    read_back, read_seconds = again.pass_for(jobs.variants[0])
    assert read_seconds == seconds and all(torch.equal(a.z_sq, b.z_sq) for a, b in zip(stats, read_back))
    other = dict(grid._pass_key(""), windows="another")
    assert load_dense_pass(stored, other, "cpu") is None  # another key: never reused
    blob = torch.load(stored, weights_only=True)
    blob["layers"][0]["z_sq"][0] += 1
    torch.save(blob, stored)
    with pytest.warns(UserWarning, match="checksum"):
        assert load_dense_pass(stored, grid._pass_key(""), "cpu") is None


def test_bad_cluster_settings_are_refused_before_any_job(tmp_path):
    with pytest.raises(ParameterError, match="cluster 'kubernetes'"):
        executor("kubernetes", tmp_path)
    with pytest.raises(ParameterError, match="timeout_mins"):
        executor("local", tmp_path, {"timeout_mins": 60})
