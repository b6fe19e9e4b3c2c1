"""Notebooks run top to bottom (their code cells, in one namespace), so they do not rot. A notebook that
reads a run directory (`MTP_RUN_DIR`) gets a small trained and validated run."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
NEEDS_A_RUN = {"validation_report.ipynb"}


def test_there_are_notebooks():
    assert NOTEBOOKS
    assert NEEDS_A_RUN <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tiny_dir, request, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")  # headless: plt.show() draws nothing
    if path.name in NEEDS_A_RUN:
        run_dir, _ = request.getfixturevalue("validated_run")
        monkeypatch.setenv("MTP_RUN_DIR", str(run_dir))
    namespace: dict = {}
    try:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                exec(compile("".join(cell["source"]), f"{path.name}[cell {i}]", "exec"), namespace)
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
