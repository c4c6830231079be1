"""The five-steps notebook (docs/notebooks/five-steps.py) executed headlessly in a real kernel, outputs checked.

One execution (module fixture) serves every assertion: nbclient runs the jupytext script as a notebook in a
fresh folder with its own MLflow store; a CLI run of the same config and seed beside it gives the metrics the
notebook must show. The DDP step is a 2-process fit started from the kernel.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import jupytext
import mlflow
import nbformat
import pytest
import yaml
from nbclient import NotebookClient

from tests.conftest import REPO, assert_bitwise_equal, cli_env, final_weights, run_fit

pytestmark = pytest.mark.e2e

NOTEBOOK = REPO / "docs" / "notebooks" / "five-steps.py"
#: The notebook's step 1, as command-line flags.
STEP_1 = ["--config", "configs/digits.yaml", "--trainer.max_epochs", "4",
          "--model.init_args.lr_scheduler.init_args.T_max", "4"]
#: The metrics the run's table shows that training decides (not timings, not dollars).
TRAINED = ("train/loss", "train/acc", "val/loss", "val/acc", "val/expected_cost", "val/bayes_expected_cost")


def kernel_env(workdir: Path) -> dict[str, str]:
    """The kernel's environment: the CLI tests' (MLflow under ``workdir``, the repository importable), one thread
    per process as the CLI run beside it (equal metrics need the same thread count)."""
    return cli_env(workdir, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[nbformat.NotebookNode, Path]:
    workdir = tmp_path_factory.mktemp("notebook")
    (workdir / "configs").symlink_to(REPO / "configs")  # the notebook names configs from the repository's root
    notebook = jupytext.read(NOTEBOOK)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    client.execute(env=kernel_env(workdir))  # raises CellExecutionError, with the cell, on any error
    return notebook, workdir


def cell_output(notebook: nbformat.NotebookNode, source_has: str) -> list[dict]:
    """The outputs of the one code cell whose source has ``source_has``."""
    (cell,) = [c for c in notebook.cells if c.cell_type == "code" and source_has in c.source]
    return cell.outputs


def text_of(outputs: list[dict]) -> str:
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


def html_rows(outputs: list[dict]) -> dict[str, str]:
    """The rows of the run table a cell displayed (``Run._repr_html_``): key -> value."""
    (shown,) = [o for o in outputs if o.output_type == "execute_result"]
    cells = re.findall(r"<tr><td[^>]*><code>(.*?)</code></td><td[^>]*>(.*?)</td></tr>", shown["data"]["text/html"])
    return {html.unescape(k): html.unescape(v) for k, v in cells}


def test_step_1_shows_the_metrics_a_cli_run_of_the_same_config_gives(executed, tmp_path: Path) -> None:
    notebook, workdir = executed
    rows = html_rows(cell_output(notebook, "EPOCHS = 4"))
    result = run_fit(workdir, *STEP_1, "--run_name", "cli", env=kernel_env(workdir))
    assert result.returncode == 0, result.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    by_name = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("digits").experiment_id])}
    (notebook_name,) = [n for n in by_name if n.startswith("digits-") and by_name[n].data.params.get(
        "trainer.max_epochs") == "4"]
    cli, ours = by_name["cli"].data.metrics, by_name[notebook_name].data.metrics
    for key in TRAINED:
        assert ours[key] == cli[key], (key, ours[key], cli[key])  # equal, not close: same config, seed, threads
        assert rows[key] == f"{cli[key]:.4f}", (key, rows[key])  # and the table the cell shows says so
    assert rows["mlflow"] == f"experiment 'digits', run {by_name[notebook_name].info.run_id}"
    assert_bitwise_equal(final_weights(workdir, notebook_name), final_weights(workdir, "cli"))


def test_the_tracking_query_lists_the_run(executed) -> None:
    notebook, _ = executed
    (table,) = [o for o in cell_output(notebook, "import mlflow") if o.output_type == "execute_result"]
    assert "FINISHED" in table["data"]["text/plain"] and "digits-" in table["data"]["text/plain"]


def test_plots_render_inline(executed) -> None:
    notebook, _ = executed
    for start in ("Image(filename=", "import matplotlib.pyplot"):
        outputs = cell_output(notebook, start)
        assert [o for o in outputs if "image/png" in o.get("data", {})], start


def test_ddp_step_runs_two_processes_from_the_kernel(executed) -> None:
    notebook, workdir = executed
    outputs = cell_output(notebook, "ddp = train(")
    streamed = text_of(outputs)
    assert "Epoch 0/0" in streamed  # the ranks' progress, streamed into the cell
    assert "atscale run —" not in streamed  # the end table is the returned run's, rendered once
    rows = html_rows(outputs)
    run_id = rows["mlflow"].rsplit(" ", 1)[1]
    run = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}").get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["atscale.strategy"] == "ddp" and run.data.tags["atscale.devices"] == "2 x 1"
    assert "amdahl/serial_fraction/world_2" in run.data.metrics  # measured under world size 2


def test_cost_table_prices_three_device_counts_on_two_markets(executed) -> None:
    notebook, _ = executed
    (table,) = [o for o in cell_output(notebook, "def tool(") if o.output_type == "execute_result"]
    lines = table["data"]["text/plain"].splitlines()
    assert lines[0].split() == ["devices", "market", "instances", "cost_usd", "wall_s"]
    assert [line.split()[1:3] for line in lines[1:]] == [
        ["1", "on_demand"], ["1", "spot"], ["8", "on_demand"], ["8", "spot"], ["64", "on_demand"], ["64", "spot"]]


def test_promotes_and_serves_the_champion(executed) -> None:
    notebook, _ = executed
    promoted = text_of(cell_output(notebook, 'print(tool("recipes.promote"'))
    assert promoted.startswith("Promoted run digits-"), promoted
    assert "alias 'champion'" in promoted
    (answers,) = [o for o in cell_output(notebook, "from datamodules.digits") if o.output_type == "execute_result"]
    lines = answers["data"]["text/plain"].splitlines()
    assert lines[0].split() == ["truth", "decision", "expected_cost"] and len(lines) == 9


def test_the_paired_script_is_what_jupytext_writes(tmp_path: Path) -> None:
    """The script is kept in jupytext's own percent format: a round trip through a notebook changes nothing."""
    text = NOTEBOOK.read_text()
    # jupytext registers nbformat's dict subclass on yaml's SafeRepresenter; once jsonargparse (imported first in a
    # worker that ran a CLI test) gave SafeDumper a table of its own, that registration never reaches SafeDumper
    yaml.SafeDumper.add_representer(nbformat.NotebookNode, yaml.representer.SafeRepresenter.represent_dict)
    notebook = jupytext.reads(text, fmt="py:percent")
    written = jupytext.writes(notebook, fmt="py:percent")
    assert [line for line in written.splitlines() if "jupytext_version" not in line] == [
        line for line in text.splitlines() if "jupytext_version" not in line]
    assert json.loads(jupytext.writes(jupytext.reads(text, fmt="py:percent"), fmt="ipynb"))["cells"]
