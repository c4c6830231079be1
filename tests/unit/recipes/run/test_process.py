"""recipes.run.process: what a launch sets for its process (stop signals, log filters, the collector, threads, NVML).

Each piece of process-wide state a test changes (signal handlers, the stop flags, environment, loggers, torch's
thread count) is put back by a fixture or ``monkeypatch``.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Iterator

import pytest
import torch

from callbacks.cpu_threads import AdaptiveCpuThreads, FixedCpuThreads
from callbacks.spot import REQUEUE_EXIT_CODE
from recipes.run import process
from recipes.run.common import SIGINT_EXIT_CODE, UsageError
from recipes.run.process import (
    NVML_CHECK_ENV,
    Interrupted,
    ReleaseInterruptedFrames,
    WrapUpSignals,
    apply_cpu_threads,
    cheap_gpu_checks,
    cpu_thread_callback,
    frozen_setup_objects,
    ignore_stop_signals,
    install_stop_signals,
    rank_exit_code,
    release_interrupted_frames,
    reset_stop_signals,
    stopping,
    wrap_up_done,
)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@pytest.fixture
def stop_signals() -> Iterator[None]:
    """The CLI's stop handlers installed, with fresh flags; the process's own handlers back afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    reset_stop_signals()
    install_stop_signals()
    yield
    reset_stop_signals()
    for signum, handler in saved.items():
        signal.signal(signum, handler)


# --------------------------------------------------------------------------------------------------- stop signals
def test_interrupted_names_its_signal() -> None:
    err = Interrupted(signal.SIGTERM)
    assert (err.signum, str(err)) == (signal.SIGTERM, "SIGTERM")
    assert isinstance(err, BaseException) and not isinstance(err, Exception)  # not caught by `except Exception`


def test_a_stop_signal_raises_interrupted_once(stop_signals) -> None:
    assert all(signal.getsignal(s) is process._raise_interrupted for s in STOP_SIGNALS)
    assert not stopping()
    with pytest.raises(Interrupted) as raised:
        signal.raise_signal(signal.SIGTERM)
    assert raised.value.signum == signal.SIGTERM and stopping()
    signal.raise_signal(signal.SIGINT)  # the process is stopping already: a second signal changes nothing
    assert stopping()


def test_a_stop_raised_inside_the_tracking_stores_query_leaves_no_traceback_of_its_cleanup(
        stop_signals, tmp_path, capsys, monkeypatch) -> None:
    """The CI's flake (a second Ctrl-C during setup): the signal landed in SQLAlchemy's ``fetchall``; its cursor
    close then failed and SQLAlchemy logged that with a traceback beside the run's one line."""
    import sqlalchemy

    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        with engine.connect() as conn, pytest.raises(Interrupted):
            conn.exec_driver_sql("select 1")
            logging.getLogger("sqlalchemy.pool.impl.QueuePool").error("Error closing cursor", exc_info=False)
            assert "Error closing cursor" in capsys.readouterr().err  # a library's error is shown before the stop
            signal.raise_signal(signal.SIGINT)
        logging.getLogger("sqlalchemy.pool.impl.QueuePool").error("Error closing cursor", exc_info=True)
        assert capsys.readouterr().err == ""  # and muted once the run is going down
        reset_stop_signals()  # the next fit in this process (a notebook's, a sweep's) sees its store's errors
        logging.getLogger("sqlalchemy.pool.impl.QueuePool").error("Error closing cursor")
        assert "Error closing cursor" in capsys.readouterr().err
    finally:
        logging.getLogger().removeHandler(handler)
        engine.dispose()


def test_after_a_ctrl_c_notice_a_ctrl_c_during_the_wrap_up_insists(stop_signals, capsys) -> None:
    """The CI's flake: Ctrl-C (a notice: checkpoint, stop), Ctrl-C again 0.15 s later, landing once training had
    ended: it was taken as the wrap-up's first signal and waited (exit 75), not as the second press (exit 130)."""
    from callbacks.utils.notices import SignalNotices

    notices: list = []
    handler = SignalNotices(["SIGINT"], notices.append)
    handler.install()
    signal.raise_signal(signal.SIGINT)  # the first press, during training: a notice
    handler.restore()
    assert len(notices) == 1
    WrapUpSignals().on_fit_end(None, None)  # type: ignore[arg-type]
    with pytest.raises(Interrupted) as raised:
        signal.raise_signal(signal.SIGINT)  # the second press: stops at once
    assert raised.value.signum == signal.SIGINT
    assert "while the run was wrapping up" not in capsys.readouterr().err
    reset_stop_signals()  # a next fit counts its own presses
    WrapUpSignals().on_fit_end(None, None)  # type: ignore[arg-type]
    signal.raise_signal(signal.SIGINT)  # a first press during this fit's wrap-up waits
    assert "SIGINT while the run was wrapping up" in capsys.readouterr().err


def test_a_stop_swallowed_by_the_code_it_landed_in_is_raised_again(stop_signals) -> None:
    """matplotlib's cleanup turned the stop into a ValueError its caller logged; the run's own code raises it again."""
    before = process.stops_raised()
    process.reraise_swallowed_stop(before)  # nothing raised yet: nothing to raise
    try:
        try:
            signal.raise_signal(signal.SIGTERM)
        except Interrupted:
            raise ValueError("Invalid bounding box") from None
    except ValueError:
        pass
    with pytest.raises(Interrupted) as raised:
        process.reraise_swallowed_stop(before)
    assert raised.value.signum == signal.SIGTERM
    # a later fit in the same process (a benchmark's rounds, a test worker) counts only its own: the CI's
    # failure, where an earlier in-process fit's handled SIGTERM was raised again into the next fit
    process.reraise_swallowed_stop(process.stops_raised())
    reset_stop_signals()  # a launch starts with none
    process.reraise_swallowed_stop(0)


def test_during_the_wrap_up_a_signal_waits_and_a_second_ctrl_c_insists(stop_signals, capsys) -> None:
    WrapUpSignals().on_fit_end(None, None)  # type: ignore[arg-type]
    signal.raise_signal(signal.SIGTERM)  # deferred: no exception
    signal.raise_signal(signal.SIGTERM)  # said once
    assert stopping()
    assert capsys.readouterr().err == ("SIGTERM while the run was wrapping up: its training is over; finishing its "
                                       "record, then exiting.\n")
    with pytest.raises(Interrupted) as raised:
        signal.raise_signal(signal.SIGINT)
    assert raised.value.signum == signal.SIGINT


def test_once_the_wrap_up_is_done_a_signal_raises_again(stop_signals) -> None:
    WrapUpSignals().on_fit_end(None, None)  # type: ignore[arg-type]
    wrap_up_done()
    with pytest.raises(Interrupted):
        signal.raise_signal(signal.SIGTERM)


def test_reset_forgets_an_earlier_fits_stop(stop_signals) -> None:
    with pytest.raises(Interrupted):
        signal.raise_signal(signal.SIGINT)
    reset_stop_signals()
    assert not stopping()
    with pytest.raises(Interrupted):
        signal.raise_signal(signal.SIGINT)


def test_ignore_stop_signals_ignores_both(stop_signals) -> None:
    ignore_stop_signals()
    assert all(signal.getsignal(s) is signal.SIG_IGN for s in STOP_SIGNALS)
    signal.raise_signal(signal.SIGTERM)  # ignored: the test goes on


@pytest.mark.parametrize(("code", "by_parent", "reported"), [
    (REQUEUE_EXIT_CODE, True, 0), (SIGINT_EXIT_CODE, True, 0),  # an orderly stop of a started rank
    (REQUEUE_EXIT_CODE, False, REQUEUE_EXIT_CODE), (SIGINT_EXIT_CODE, False, SIGINT_EXIT_CODE),
    (1, True, 1), (2, True, 2), (0, True, 0),
])
def test_rank_exit_code(code: int, by_parent: bool, reported: int) -> None:
    assert rank_exit_code(code, by_parent) == reported


class Held:
    """An object whose life shows whether a frame's locals were freed."""


def _interrupted_holding(held: list[weakref.ref], exc: BaseException) -> None:
    local = Held()
    held.append(weakref.ref(local))
    raise exc


@pytest.mark.parametrize(("exc", "freed"), [(Interrupted(signal.SIGTERM), True), (KeyboardInterrupt(), True),
                                            (ValueError("a failure"), False)])
def test_a_stop_exceptions_frames_release_their_locals_a_failures_keep_them(exc: BaseException, freed: bool) -> None:
    held: list[weakref.ref] = []
    try:
        _interrupted_holding(held, exc)
    except BaseException as err:  # the exception under test
        caught = err
    release_interrupted_frames(caught)
    assert (held[0]() is None) is freed


def test_the_callback_releases_on_exception() -> None:
    held: list[weakref.ref] = []
    try:
        _interrupted_holding(held, Interrupted(signal.SIGINT))
    except Interrupted as err:
        ReleaseInterruptedFrames().on_exception(None, None, err)  # type: ignore[arg-type]
    assert held[0]() is None


# ------------------------------------------------------------------------------------------------- CPU threads
@pytest.fixture
def threads(monkeypatch) -> list[int]:
    """The counts set on torch (recorded, not applied)."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


@pytest.mark.parametrize("mode", ["auto", "adaptive", "torch"])
def test_a_thread_mode_sets_nothing(threads: list[int], mode: str) -> None:
    apply_cpu_threads(mode)
    assert threads == []


def test_a_thread_count_is_set_on_torch(threads: list[int]) -> None:
    apply_cpu_threads("3")
    assert threads == [3]


@pytest.mark.parametrize("setting", ["0", "-1", "two", "1.5", ""])
def test_a_bad_thread_setting_is_refused_by_value(threads: list[int], setting: str) -> None:
    with pytest.raises(UsageError) as refused:
        apply_cpu_threads(setting)
    assert str(refused.value) == (f"--cpu_threads {setting!r}: expected 'auto', 'adaptive', 'torch' or a positive "
                                  "integer.")
    assert threads == []


def test_the_thread_callback_for_each_setting(monkeypatch, caplog) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for setting in ("auto", "torch", "4"):
        assert type(cpu_thread_callback(setting, [])) is FixedCpuThreads
    with caplog.at_level(logging.WARNING, logger=process.__name__):
        assert type(cpu_thread_callback("adaptive", [])) is AdaptiveCpuThreads
    assert caplog.messages == ["--cpu_threads adaptive: the thread count follows the machine's load, so this run's "
                               "weights do too; a resumed or reproduced run will not be bitwise identical."]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a launcher divided the cores
    assert cpu_thread_callback("adaptive", []) is None
    assert cpu_thread_callback("auto", [FixedCpuThreads()]) is None  # the config brings its own
    assert cpu_thread_callback("adaptive", [AdaptiveCpuThreads()]) is None


# ------------------------------------------------------------------------------------ collector, NVML, logging
def test_objects_alive_on_entry_are_frozen_inside_and_collectable_after() -> None:
    before = gc.get_freeze_count()
    with frozen_setup_objects():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == 0


def test_without_a_gpu_the_nvml_check_is_off_inside_and_back_after(monkeypatch) -> None:
    monkeypatch.setenv(NVML_CHECK_ENV, "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with cheap_gpu_checks():
        assert NVML_CHECK_ENV not in os.environ
    assert os.environ[NVML_CHECK_ENV] == "1"


def test_with_a_gpu_or_without_the_variable_nothing_changes(monkeypatch) -> None:
    monkeypatch.setenv(NVML_CHECK_ENV, "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with cheap_gpu_checks():
        assert os.environ[NVML_CHECK_ENV] == "1"
    monkeypatch.delenv(NVML_CHECK_ENV)
    with cheap_gpu_checks():
        assert NVML_CHECK_ENV not in os.environ
    assert NVML_CHECK_ENV not in os.environ


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("x", logging.INFO, __file__, 1, msg, None, None)


def test_drop_lines_drops_records_by_their_messages_start() -> None:
    drop = process._DropLines("💡 Tip:", "Seed set")
    assert [drop.filter(_record(m)) for m in ("💡 Tip: try litlogger", "Seed set to 0", "a real warning",
                                              " 💡 Tip: indented")] == [False, False, True, True]


def test_drop_out_of_space_drops_only_records_of_a_full_disk() -> None:
    drop = process._DropOutOfSpace()
    full = _record("write failed")
    full.exc_info = (OSError, OSError(28, "No space left on device"), None)
    other = _record("write failed")
    other.exc_info = (OSError, OSError(13, "Permission denied"), None)
    assert (drop.filter(full), drop.filter(other), drop.filter(_record("no exception"))) == (False, True, True)
    try:  # logged inside an `except`, without exc_info: the exception being handled decides
        raise OSError(28, "No space left on device")
    except OSError:
        assert drop.filter(_record("MLflow's async writer failed")) is False


def test_quiet_known_noise_twice_adds_each_filter_once(monkeypatch) -> None:
    monkeypatch.delenv(process.MLFLOW_QUIET_URL_ENV, raising=False)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    writer = logging.getLogger(process.MLFLOW_WRITE_LOGGERS[0])
    monkeypatch.setattr(rank_zero, "filters", [])
    monkeypatch.setattr(writer, "filters", [])
    for name in ("lightning.fabric.utilities.seed", "mlflow.system_metrics", "alembic"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    monkeypatch.setattr("warnings.filters", list(__import__("warnings").filters))
    process.quiet_known_noise()
    process.quiet_known_noise()
    assert rank_zero.filters == [process._DROP_TIP] and writer.filters == [process._DROP_OUT_OF_SPACE]
    assert os.environ[process.MLFLOW_QUIET_URL_ENV] == "true"
    assert {logging.getLogger(n).level for n in ("lightning.fabric.utilities.seed", "mlflow.system_metrics",
                                                 "alembic")} == {logging.WARNING}


def test_quiet_known_noise_keeps_a_users_url_setting(monkeypatch) -> None:
    monkeypatch.setenv(process.MLFLOW_QUIET_URL_ENV, "false")
    monkeypatch.setattr("warnings.filters", list(__import__("warnings").filters))
    process.quiet_known_noise()
    assert os.environ[process.MLFLOW_QUIET_URL_ENV] == "false"


def test_quiet_lightning_info_sets_lightnings_loggers_to_warning(monkeypatch) -> None:
    names = ["lightning.pytorch", "pytorch_lightning"]
    for name in names:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.INFO)
    process.quiet_lightning_info()
    assert logging.getLogger("lightning.pytorch").level == logging.WARNING
    if "pytorch_lightning" in sys.modules:
        assert logging.getLogger("pytorch_lightning").level == logging.WARNING


def test_after_a_stop_the_broken_clean_ups_of_libraries_print_nothing(stop_signals, monkeypatch, capsys) -> None:
    """Seen in CI: a Ctrl-C at start-up raised inside SQLAlchemy's weakref clean-up, and every later clean-up
    printed "Exception ignored in ... AssertionError" under the run's one line."""
    seen: list[object] = []
    hook = seen.append
    monkeypatch.setattr(sys, "unraisablehook", hook)
    process.quiet_known_noise()
    process.quiet_known_noise()  # a second launch in the process does not wrap the hook twice
    assert sys.unraisablehook.previous is hook  # type: ignore[attr-defined]

    class Broken:
        pass

    def clean_up(_ref: object) -> None:
        raise AssertionError  # a clean-up whose bookkeeping a stop broke

    first = Broken()
    keep = weakref.ref(first, clean_up)
    del first
    gc.collect()
    assert len(seen) == 1  # no stop yet: a library's unraisable error is reported as ever
    with pytest.raises(process.Interrupted):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler raises at the next bytecode the main thread runs
            time.sleep(0.001)
    assert process.stopping()
    second = Broken()
    keep = weakref.ref(second, clean_up)
    del second
    gc.collect()
    assert len(seen) == 1 and keep() is None  # after the stop: dropped
