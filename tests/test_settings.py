"""A run's settings have one home, ``spap_lib.settings.RunConfig``: the notebooks' parameter cells, ``spap prune``'s
and ``spap plan``'s options, the plan's defaults and ``configs/paper.yaml`` read it, so that changing a default is
one line."""
from __future__ import annotations

import ast
import dataclasses
import json

import pytest
import yaml

from spap_lib import REPO
from spap_lib.checks import ParameterError
from spap_lib.cli import parser
from spap_lib.settings import PAPER, RunConfig

FIELDS = {f.name for f in dataclasses.fields(RunConfig)}
# The command line keeps kept widths that llama.cpp's blocks divide by default (docs/llamacpp.md); 02 keeps the
# paper's own widths.
CLI_ONLY = {"round_to": "auto"}


def _parameters(name: str) -> list[ast.AnnAssign]:
    cell = next(c for c in json.loads((REPO / f"notebooks/{name}.ipynb").read_text())["cells"]
                if "parameters" in c.get("metadata", {}).get("tags", []))
    return [n for n in ast.parse("".join(cell["source"])).body if isinstance(n, ast.AnnAssign)]


def _reads_paper(node: ast.AnnAssign) -> bool:
    """``name: T = PAPER.name`` (a mapping: ``dict(PAPER.name)``, a copy)."""
    value = node.value.args[0] if isinstance(node.value, ast.Call) and node.value.func.id == "dict" else node.value
    return ast.unparse(value) == f"PAPER.{node.target.id}"


@pytest.mark.parametrize("name", ["01_calibrate", "02_prune", "03_ablate"])
def test_every_run_setting_a_notebook_declares_reads_its_default_from_the_config(name):
    shared = [n for n in _parameters(name) if n.target.id in FIELDS]
    assert shared, f"{name} declares no run setting"
    literal = [n.target.id for n in shared if not _reads_paper(n)]
    assert not literal, f"{name}: {literal} restate a default of spap_lib/settings.py; write name: T = PAPER.name"


def test_02_takes_every_setting_of_a_prune():
    declared = {n.target.id for n in _parameters("02_prune")}
    assert FIELDS - {"evaluate"} <= declared  # 02 always measures both models


def test_the_rule_finds_a_restated_default():
    node = ast.parse("nsamples: int = 128").body[0]
    assert not _reads_paper(node)
    assert _reads_paper(ast.parse("nsamples: int = PAPER.nsamples").body[0])
    assert _reads_paper(ast.parse("hparams: dict = dict(PAPER.hparams)").body[0])


def test_the_commands_options_are_the_configs_fields_with_its_defaults():
    prune = parser().parse_args(["prune", "m", "--out", "o"])
    for f in dataclasses.fields(RunConfig):
        if not f.metadata["option"]:
            continue
        assert getattr(prune, f.name) == CLI_ONLY.get(f.name, getattr(PAPER, f.name)), f.name
    plan = parser().parse_args(["plan", "m"])
    assert (plan.nsamples, plan.seqlen, plan.sparsity) == (PAPER.nsamples, PAPER.seqlen, PAPER.sparsity)
    assert parser().parse_args(["prune", "m", "--out", "o", "--round-to", "q4_k_m"]).round_to == "q4_k_m"
    assert parser().parse_args(["prune", "m", "--out", "o", "--hparams", '{"K": 3}']).hparams == {"K": 3}


def test_the_plans_and_the_methods_defaults_are_the_configs():
    from spap_lib.methods import DEFAULT_METHOD
    from spap_lib.plan import PlanRequest

    asked = PlanRequest()
    assert all(getattr(asked, k) == getattr(PAPER, k) for k in ("method", "sparsity", "nsamples", "seqlen",
                                                                 "eval_seqlen", "eval_windows"))
    assert DEFAULT_METHOD == PAPER.method


def test_the_paper_config_file_does_not_restate_a_default():
    config = yaml.safe_load((REPO / "configs/paper.yaml").read_text())
    restated = sorted(k for k in config.keys() & FIELDS if config[k] == getattr(PAPER, k))
    assert not restated, f"configs/paper.yaml restates {restated}: the notebooks' defaults are the paper's already"


def test_a_config_is_checked_field_by_field_naming_the_option():
    assert PAPER.check() is PAPER
    with pytest.raises(ParameterError, match="nsamples"):
        RunConfig(nsamples=0).check()
    with pytest.raises(ParameterError, match="sparsity"):
        PAPER.replace(sparsity=1.0).check()
