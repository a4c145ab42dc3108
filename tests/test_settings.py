"""A prune's settings have one home, ``spap_lib.settings.PruneSettings``: notebook 02's parameter cell (literals, for
papermill) and ``spap prune``'s options hold its defaults, and both run ``spap_lib.run.PruneRun``'s steps."""
from __future__ import annotations

import ast
import dataclasses
import json

from spap_lib import REPO
from spap_lib.cli import parser
from spap_lib.settings import PruneSettings

# The command line keeps kept widths that llama.cpp's blocks divide by default (docs/llamacpp.md); 02 keeps the
# paper's own widths. The other settings, and the options' names, are the same.
CLI_ONLY = {"round_to": "auto"}
NOT_ON_THE_COMMAND_LINE = {"propagate"}  # each method's own setting there


def _notebook_defaults(name: str = "02_prune") -> dict:
    cell = next(c for c in json.loads((REPO / f"notebooks/{name}.ipynb").read_text())["cells"]
                if "parameters" in c.get("metadata", {}).get("tags", []))
    tree = ast.parse("".join(cell["source"]))
    return {n.target.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.AnnAssign)}


def _defaults() -> dict:
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(PruneSettings) if f.name != "model"}


def test_the_notebooks_defaults_are_the_settings_defaults():
    notebook = _notebook_defaults()
    for name, value in _defaults().items():
        if name != "evaluate":  # 02 always measures both models
            assert notebook[name] == value, name


def test_the_other_notebooks_and_the_plan_share_the_calibration_and_evaluation_defaults():
    import inspect

    from spap_lib.plan import plan

    shared = {k: v for k, v in _defaults().items() if k in ("nsamples", "seqlen", "eval_seqlen", "seed")}
    for name in ("01_calibrate", "03_ablate"):
        notebook = _notebook_defaults(name)
        assert {k: notebook[k] for k in shared if k in notebook} == {k: v for k, v in shared.items() if k in notebook}
    defaults = inspect.signature(plan).parameters
    assert all(defaults[k].default == shared[k] for k in ("nsamples", "seqlen", "eval_seqlen"))


def test_the_commands_defaults_are_the_settings_defaults():
    prune = parser().parse_args(["prune", "m", "--out", "o"])
    for name, value in _defaults().items():
        if name in NOT_ON_THE_COMMAND_LINE:
            continue
        given = not prune.no_eval if name == "evaluate" else getattr(prune, name)
        assert given == CLI_ONLY.get(name, value), name
