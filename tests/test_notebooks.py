"""Every notebook under notebooks/ runs top to bottom without an error, with the small settings
that LITHOS_NOTEBOOK_TINY=1 selects in its first cell."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .conftest import require

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_are_there():
    names = {p.stem for p in NOTEBOOKS}
    assert {"quickstart", "speculative_decoding", "roofline", "batch_evaluation"} <= names


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory) -> str:
    """A JAX compilation cache shared by the notebooks' kernels: notebooks that decode the same
    shapes (batch, prompt bucket, drafter) compile them once."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax-cache"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch, smollm2_gguf, compilation_cache):
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    require("ipykernel")
    # The kernel inherits this environment: lithos from this checkout, small settings, and the
    # session's conversion cache (so the default model is converted once for all notebooks).
    monkeypatch.setenv("LITHOS_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", compilation_cache)
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}")
