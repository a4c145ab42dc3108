"""One parameter file for the whole notebook chain, split per notebook.

``configs/*.yaml`` hold the parameters of every notebook of the chain 01 -> 05. A notebook refuses a
name it does not declare (``check_notebook_parameters``), so each one is given the subset it
declares; a name that no notebook declares is a typo and stops the chain before anything runs.

    python -m spap_lib.nbparams configs/smoke.yaml notebooks/02_prune.ipynb > 02.yaml
    papermill notebooks/02_prune.ipynb out.ipynb -f 02.yaml
"""
from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import yaml

from spap_lib.checks import ParameterError
from spap_lib.files import REPO

NOTEBOOKS = REPO / "notebooks"


@cache
def declared(notebook: str | Path) -> frozenset[str]:
    """The parameter names of a notebook's parameters cell, as papermill itself parses them."""
    import papermill

    return frozenset(papermill.inspect_notebook(str(notebook)))


def for_notebook(config: dict | str | Path, notebook: str | Path) -> dict:
    """The entries of a chain parameter file that ``notebook`` declares (all names checked)."""
    where = config if not isinstance(config, dict) else "parameters"
    if not isinstance(config, dict):
        config = yaml.safe_load(Path(config).read_text()) or {}
    known = frozenset().union(*(declared(nb) for nb in sorted(NOTEBOOKS.glob("*.ipynb"))))
    unknown = sorted(set(config) - known)
    if unknown:
        raise ParameterError(f"{where}: {', '.join(unknown)} is not a parameter of any notebook in {NOTEBOOKS}")
    mine = declared(Path(notebook))
    return {k: v for k, v in config.items() if k in mine}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m spap_lib.nbparams CONFIG.yaml NOTEBOOK.ipynb > params.yaml")
    try:
        sys.stdout.write(yaml.safe_dump(for_notebook(args[0], args[1]), sort_keys=False))
    except ParameterError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
