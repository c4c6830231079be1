"""The CLI's one-line messages, from jsonargparse's real error texts (captured from this version)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from recipes.run.context import refused_changes, resumable_change
from recipes.run.errors import parse_error_message
from recipes.run.process import rank_exit_code

MAX_EPOCHS = ('Parser key "trainer.max_epochs":\n  Does not validate against any of the Union subtypes\n  Subtypes: '
              "[<class 'int'>, <class 'NoneType'>]\n  Errors:\n    - Expected a <class 'int'>\n    - Expected a "
              "<class 'NoneType'>\n  Given value type: <class 'str'>\n  Given value: many")
BATCH = ('Parser key "data":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class '
         "'lightning.pytorch.core.datamodule.LightningDataModule'>, <class 'NoneType'>]\n  Errors:\n    - Problem "
         "with given class_path 'datamodules.digits.DigitsDataModule':\n        Parser key \"batch_size\":\n          "
         "Expected a <class 'int'>. Got value: x\n    - Expected a <class 'NoneType'>\n  Given value type: <class "
         "'jsonargparse._util.NestedArg'>\n  Given value: NestedArg(key='batch_size', val='x')")
LR = ('Parser key "model":\n  Does not validate against any of the Union subtypes\n  Errors:\n    - Problem with '
      "given class_path 'recipes.classifier.ImageClassifier':\n        Parser key \"optimizer\":\n          Type "
      "typing.Callable expects a function or a callable class: Parser key \"lr\":\n\n            - Expected a path "
      "but abc either not accessible or invalid\n            Errors:\n              - Expected a <class 'float'>\n"
      "            Given value: abc. Got value: Namespace(class_path='torch.optim.AdamW')\n    - Expected a <class "
      "'NoneType'>\n  Given value type: <class 'jsonargparse._util.NestedArg'>\n  Given value: "
      "NestedArg(key='optimizer.init_args.lr', val='abc')")
REFUSED_BY_CLASS = ('Parser key "data":\n  Does not validate against any of the Union subtypes\n  Errors:\n    - '
                    "Problem with given class_path 'datamodules.vision.MNISTDataModule': data/MNIST is missing and "
                    "download is false\n    - Expected a <class 'NoneType'>\n  Given value: NestedArg(key="
                    "'download', val='false')")


@pytest.mark.parametrize(("message", "expected"), [
    (MAX_EPOCHS, "trainer.max_epochs: expected int, got 'many'"),
    (BATCH, "data.init_args.batch_size: expected int, got 'x'"),
    (LR, "model.init_args.optimizer.init_args.lr: expected float, got 'abc'"),
    (REFUSED_BY_CLASS, "data.init_args.download: data/MNIST is missing and download is false"),
    ("unrecognized arguments: --x 1", "unrecognized arguments: --x 1"),
])
def test_parse_error_message(message: str, expected: str) -> None:
    assert parse_error_message(message) == expected


@pytest.mark.parametrize(("key", "resumable"), [
    ("trainer.max_epochs", True), ("spot.every_n_steps", True), ("checkpoint.dirpath", True), ("config", True),
    ("trainer.strategy.init_args.data_parallel_size", True), ("model.init_args.optimizer.init_args.lr", False),
    ("data.init_args.batch_size", False), ("seed_everything", False), ("trainer.precision", False),
    ("checkpoint.monitor", False), ("spotless", False),
])
def test_resumable_change(key: str, resumable: bool) -> None:
    assert resumable_change(key) is resumable


def test_refused_changes_lists_only_changed_keys_that_would_be_ignored() -> None:
    logged = {"trainer.max_epochs": "1", "model.lr": "0.003", "seed_everything": "42", "gone": "x"}
    new = {"trainer.max_epochs": "2", "model.lr": "0.01", "seed_everything": "42", "added": "y"}
    assert refused_changes(logged, new) == [("model.lr", "0.003", "0.01")]


@pytest.mark.parametrize(("max_epochs", "expected"), [(-1, "Epoch 0"), (20, "Epoch 0/19"), (None, "Epoch 0")])
def test_progress_bar_has_no_negative_epoch_total(max_epochs: int | None, expected: str) -> None:
    from types import SimpleNamespace

    from callbacks.progress import RunProgressBar

    bar = RunProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs)  # what the description reads
    assert bar._get_train_description(0).strip() == expected


# ------------------------------------------------------------------ the end-of-run table
class _Rows:
    """A callback that adds rows to the end summary (as Baselines, SpotCheckpoint, CostTracker do)."""

    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        return [("spot/lost_steps", f"{metrics['train/loss'] * 0:.0f} (resumed at step 40)")]


def _summary(capsys: pytest.CaptureFixture[str], interrupted: bool, with_mlflow: bool = True) -> list[str]:
    import torch

    from recipes.run.cli import AtscaleCLI

    stub = SimpleNamespace(
        context=SimpleNamespace(experiment="digits", tracking_uri="https://alice:s3cret@mlflow.example/x",
                                location="runs/digits/r1"),
        trainer=SimpleNamespace(callback_metrics={"val/acc": torch.tensor(0.97651), "train/loss": 0.25,
                                                  "per_class": torch.zeros(3)},  # not a scalar: left out
                                callbacks=[_Rows(), object()], global_step=57),
        mlflow_logger=lambda: SimpleNamespace(run_id="0123abcd") if with_mlflow else None,
    )
    AtscaleCLI.print_summary(*AtscaleCLI.summary_rows(stub, duration=12.34, interrupted=interrupted))  # type: ignore[arg-type]
    return [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip()]


def _title(lines: list[str]) -> str:
    """The table's title: the lines above its top border, joined."""
    return " ".join(lines[:next(i for i, line in enumerate(lines) if line.startswith(("┏", "┌")))])


def _cells(lines: list[str]) -> list[list[str]]:
    """The table's rows as lists of cells (the box-drawing borders dropped)."""
    rows = []
    for line in lines:
        cells = [c.strip() for c in line.strip("│┃").split("│")]
        if len(cells) == 2 and any(cells):
            rows.append(cells)
    return rows


def test_summary_of_an_interrupted_run_says_so_and_how_to_resume(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _summary(capsys, interrupted=True)
    assert _title(lines) == "atscale run — INTERRUPTED (relaunch the same command to resume)"  # rich may wrap it
    assert _cells(lines) == [
        ["train/loss", "0.2500"],
        ["val/acc", "0.9765"],
        ["spot/lost_steps", "0 (resumed at step 40)"],
        ["duration", "12.3 s (global step 57)"],
        ["mlflow", "experiment 'digits', run 0123abcd"],
        ["tracking", "https://alice:***@mlflow.example/x"],  # the password never reaches the log
        # the run's page once (MLflow's own "View run" lines are off), without the credentials
        ["view", "https://mlflow.example/x/#/experiments/0/runs/0123abcd (the Training runs tab; charts under "
                 "Model metrics)"],
        ["run dir", "runs/digits/r1"],
    ]


def test_summary_of_a_finished_run_without_mlflow(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _summary(capsys, interrupted=False, with_mlflow=False)
    assert _title(lines) == "atscale run — finished"
    assert [row[0] for row in _cells(lines)] == ["train/loss", "val/acc", "spot/lost_steps", "duration",
                                                     "run dir"]


def test_cheap_gpu_checks_drop_the_nvml_check_only_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from recipes.run.process import NVML_CHECK_ENV, cheap_gpu_checks

    monkeypatch.setenv(NVML_CHECK_ENV, "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with cheap_gpu_checks():
        assert NVML_CHECK_ENV not in os.environ
    assert os.environ[NVML_CHECK_ENV] == "1"  # restored
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with cheap_gpu_checks():
        assert os.environ[NVML_CHECK_ENV] == "1"  # a GPU: Lightning's fork-safe check stays


@pytest.mark.skipif(not torch.cuda._is_compiled(), reason="a CPU-only build of torch never asks NVML")
def test_without_the_nvml_check_a_step_no_longer_asks_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.run.process import NVML_CHECK_ENV, cheap_gpu_checks

    if torch.cuda.device_count() > 0:
        pytest.skip("a GPU is present: the check is kept")
    calls = []
    real = torch.cuda._device_count_nvml
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: calls.append(1) or real())
    monkeypatch.setenv(NVML_CHECK_ENV, "1")
    for _ in range(3):  # what every optimizer.step() asks
        torch.accelerator.current_accelerator(check_available=True)
    asked_with = len(calls)
    with cheap_gpu_checks():  # it asks once itself, on entry
        before = len(calls)
        for _ in range(3):
            torch.accelerator.current_accelerator(check_available=True)
        asked_without = len(calls) - before
    assert (asked_with, asked_without) == (3, 0)


@pytest.mark.parametrize("stop_code", [75, 130])
def test_a_further_rank_stopping_in_order_leaves_the_launching_process_alive(stop_code: int) -> None:
    """Lightning's real observer over a rank that stopped in order (CI saw the launching process's 75 become -9)."""
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    launching = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    rank = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({rank_exit_code(stop_code, True)})"])
    try:
        rank.wait(timeout=30)
        observer = _ChildProcessObserver(main_pid=launching.pid, child_processes=[rank], sleep_period=0)
        assert observer._run() is True  # done watching: every rank it started ended with 0
        assert launching.poll() is None  # not SIGKILLed
    finally:
        launching.kill()
        launching.wait()


@pytest.mark.parametrize(("started_rank", "reported"), [(False, 75), (True, 0)])
def test_a_components_exit_75_is_a_stop_a_started_rank_reports_as_0(monkeypatch: pytest.MonkeyPatch,
                                                                    started_rank: bool, reported: int) -> None:
    """Streamed data gone ends a rank with ``SystemExit(75)`` from inside the fit. In a rank Lightning's launcher
    started, that 75 reached the interpreter as it was: the launcher's observer saw a child exit non-zero and
    SIGKILLed the launching process, whose own 75 became -9 (1 of 4 DDP outages here). It is a stop like a
    notice: the launching process reports it, a started rank exits 0."""
    from recipes.run import cli
    from recipes.run.context import ENV_RUN_NAME

    class StreamGone:
        summary = None

        def __init__(self, **kwargs: object) -> None:
            pass

        def fit(self) -> int:
            raise SystemExit(75)

        def _release_lock(self) -> None:
            pass

    monkeypatch.setattr(cli, "AtscaleCLI", StreamGone)
    monkeypatch.setenv("LOCAL_RANK", "1" if started_rank else "0")
    monkeypatch.setenv(ENV_RUN_NAME, "r")
    monkeypatch.setattr(cli, "install_stop_signals", lambda: None)  # this process's handlers stay pytest's
    monkeypatch.setattr(cli, "ignore_stop_signals", lambda: None)
    assert cli.run_cli([]) == reported


def test_a_stop_just_after_the_mlflow_run_exists_marks_it_killed(fit_in_process, tmp_path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM between the run's creation and the start of training (a DDP launch killed as its ranks met) left
    the MLflow run RUNNING while the process exited 75: the relaunch found a run that no one had ended."""
    import signal

    from recipes.run.cli import AtscaleCLI
    from recipes.run.process import Interrupted
    from tests.conftest import CONFIGS, FAST, runs_of

    def stop(*args: object, **kwargs: object) -> None:
        raise Interrupted(signal.SIGTERM)  # what the CLI's handler raises on a SIGTERM outside training

    # the system-metrics sampler starts once the run exists, before training: the signal lands there
    monkeypatch.setattr(AtscaleCLI, "_start_system_metrics", staticmethod(stop))
    result = fit_in_process("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false",
                            "--run_name", "k")
    assert result.returncode == 75, result.stderr[-3000:]
    assert [(r.info.run_name, r.info.status) for r in runs_of(tmp_path, "digits")] == [("k", "KILLED")]


@pytest.mark.parametrize(("flag", "started"), [((), True), (("--system_metrics", "false"), False)])
def test_the_system_metrics_sampler_has_a_switch(fit_in_process, tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                 flag: tuple[str, ...], started: bool) -> None:
    """MLflow's sampler is a thread beside the step: on by default, off with one flag, and the run is the same."""
    from recipes.run.cli import AtscaleCLI
    from tests.conftest import CONFIGS, FAST, runs_of

    calls: list[bool] = []
    monkeypatch.setattr(AtscaleCLI, "_start_system_metrics",
                        staticmethod(lambda run_id, resume: calls.append(resume)))
    result = fit_in_process("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false",
                            "--trainer.max_epochs", "1", "--run_name", "s", *flag)
    assert result.returncode == 0, result.stderr[-3000:]
    assert calls == ([False] if started else [])
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FINISHED" and run.data.params["system_metrics"] == str(started)


@pytest.mark.parametrize(("signal_name", "code", "status"), [("SIGINT", 130, "KILLED"), ("SIGTERM", 75, "KILLED")])
def test_a_stop_in_the_middle_of_a_store_read_still_ends_the_run(fit_in_process, tmp_path, signal_name: str,
                                                                 code: int, status: str) -> None:
    """A Ctrl-C at start-up landed inside a SQLite read (the CI failure of 2026-12-05): the run's "ended" write
    waited on the read's lock, kept by the exception's traceback, and the launch exited 1 after 46 s."""
    from tests.conftest import CONFIGS, FAST, runs_of

    result = fit_in_process("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false",
                            "--run_name", "r", "--trainer.callbacks+=tests.faults.SignalMidStoreRead",
                            f"--trainer.callbacks.signal_name={signal_name}")
    assert result.returncode == code, result.stderr[-3000:]
    assert "database is locked" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"interrupted ({signal_name}): the run stopped; relaunch the same command to resume it.")
    assert [(r.info.run_name, r.info.status) for r in runs_of(tmp_path, "digits")] == [("r", status)]


def test_only_a_stops_frames_are_released() -> None:
    """The stop's interrupted frames lose their locals (an open cursor, its lock); a failure's stay for a
    post-mortem, and both tracebacks keep their lines."""
    import signal
    import traceback

    from recipes.run.process import Interrupted, release_interrupted_frames

    def raising(err: BaseException) -> None:
        held = object()  # noqa: F841 - the local a post-mortem reads
        raise err

    for err, kept in ((Interrupted(signal.SIGINT), False), (KeyboardInterrupt(), False), (ValueError("x"), True)):
        try:
            raising(err)
        except BaseException as caught:
            release_interrupted_frames(caught)
            inner = caught.__traceback__.tb_next
            assert ("held" in inner.tb_frame.f_locals) is kept, err
            assert traceback.extract_tb(caught.__traceback__)[-1].name == "raising"
