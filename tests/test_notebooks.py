"""The example notebooks run top to bottom and are stored executed, with their pictures.

Each notebook is executed with nbclient in a temporary copy (the stored outputs are not
touched) on a kernel that runs *this* interpreter, so the notebooks see the cpkv under test.
The copy sits next to copies of the notebooks' helper modules (``examples/*.py``, e.g.
``cp_helpers.py``, which is not part of the wheel), as in ``examples/``: the kernel's working
directory is on ``sys.path``, and ranks started by ``cpkv.launch.spawn`` inherit it.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
HELPERS = sorted(EXAMPLES.glob("*.py"))
EXPECTED = ["01_prefix_kv_plan.ipynb", "02_cp_attention_end_to_end.ipynb", "03_use_in_your_model.ipynb"]
CELL_TIMEOUT_S = 100
NOTEBOOK_BUDGET_S = 120  # issue 7: each notebook runs top to bottom in under 2 minutes on 2 CPU cores
KERNEL_NAME = "cpkv-test-python"


def _client(nb: nbformat.NotebookNode, workdir: Path) -> NotebookClient:
    """An nbclient for ``nb`` whose kernel is ``sys.executable`` (not whatever ``python3`` resolves to)."""
    kernels = workdir / "kernels"
    (kernels / KERNEL_NAME).mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "cpkv tests",
        "language": "python",
    }
    (kernels / KERNEL_NAME / "kernel.json").write_text(json.dumps(spec))
    manager = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
    return NotebookClient(
        nb, km=manager, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(workdir)}}, allow_errors=False
    )


def _outputs(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]


def test_the_three_notebooks_exist() -> None:
    assert [p.name for p in NOTEBOOKS] == EXPECTED


@pytest.mark.timeout(60)
def test_kernel_is_this_interpreter(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    _client(nb, tmp_path).execute()
    assert _outputs(nb)[0]["text"].strip() == sys.executable


@pytest.mark.timeout(NOTEBOOK_BUDGET_S + 60)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    stored = path.read_bytes()
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    for helper in HELPERS:  # the notebooks import their helpers from their own directory
        shutil.copy(helper, tmp_path / helper.name)
    nb = nbformat.read(copy, as_version=4)
    start = time.perf_counter()
    _client(nb, tmp_path).execute()  # raises CellExecutionError at the first failing cell
    elapsed = time.perf_counter() - start
    assert not [out for out in _outputs(nb) if out.output_type == "error"]
    assert elapsed < NOTEBOOK_BUDGET_S, f"{path.name} took {elapsed:.0f} s"
    assert any("image/png" in out.get("data", {}) for out in _outputs(nb))
    assert path.read_bytes() == stored, "executing must not modify the stored notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_executed_with_pictures(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    counts = [cell.execution_count for cell in nb.cells if cell.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), "re-execute the notebook top to bottom before committing it"
    outputs = _outputs(nb)
    assert not [out for out in outputs if out.output_type == "error"]
    assert any("image/png" in out.get("data", {}) for out in outputs), "pictures must be stored as PNG outputs"


# What each notebook must (still) teach: the public names its code cells call.
TEACHES = {
    "01_prefix_kv_plan.ipynb": [
        "compute_prefix_kv_cu_seqlens", "bsnd_cu_seqlens", 'layout="zigzag"', "pad_documents", "shard_zigzag_tnd",
        "zigzag_tnd_gather_index", "gather_rows", "check_zigzag_tnd_lengths",
    ],
    "02_cp_attention_end_to_end.ipynb": [
        "from cp_helpers import", "run_examples", "per_rank_ring", "reference_forward(", 'exchange="need"',
        "windows=", "ring_degree=",
    ],
    "03_use_in_your_model.ipynb": [
        "gather_from_sp_cp", "global_num_seqs", 'plan_attention(cu_seqlens', 'exchange="need"', ".kv_source(",
        "exchange_rows", "BackwardOrder(", ".attach(",
    ],
}


REMOVED_IN_0_2 = [
    "plan_attention_bsnd", "plan_attention_zigzag_tnd", "attention_forward_bsnd", "attention_forward_zigzag_tnd",
    "attend_prefix", "plan_need_exchange", "need_windows", "forward_bsnd", "forward_zigzag_tnd", ".reference_forward(",
    "cpkv.tutorial", "cpkv.ring", "kv_rows", "IndexerLossConfig",
]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_the_current_api(path: Path) -> None:
    """No call of an API removed in 0.2.0, and imports only from cpkv's public modules and the helpers."""
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")
    assert not [name for name in REMOVED_IN_0_2 if name in code]
    private = [line for line in code.splitlines() if line.lstrip().startswith(("from cpkv.", "import cpkv."))
               and line.split()[1] not in ("cpkv.launch", "cpkv.v4", "cpkv.commstats")]
    assert not private, f"{path.name} imports internals: {private}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_covers_its_topics_without_placeholders(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")
    missing = [name for name in TEACHES[path.name] if name not in code]
    assert not missing, f"{path.name} no longer calls {missing}"
    assert not [cell.source[:60] for cell in nb.cells if "(coming" in cell.source], "a '(coming: ...)' placeholder is left"
