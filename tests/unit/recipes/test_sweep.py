"""recipes.sweep in-process: the space file, bad input (exit 2, one line, before any trial), the study's claims
and hand-backs on a real sqlite storage, per-trial sampler seeds, and the money arithmetic of the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from recipes import sweep
from recipes.run.common import UsageError
from recipes.sweep import report, study
from recipes.sweep.space import check_fixed, load_space, override_args
from tests.conftest import CONFIGS, client_for

LR = "model.init_args.optimizer.init_args.lr"


def space_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------------------------------ the space
def test_the_shipped_digits_space_loads_as_these_distributions() -> None:
    space = load_space(str(CONFIGS / "sweeps" / "digits.yaml"))
    assert space == {
        LR: FloatDistribution(1e-4, 3e-2, log=True),
        "model.init_args.optimizer.init_args.weight_decay": FloatDistribution(1e-6, 1e-2, log=True),
        "model.init_args.width": IntDistribution(16, 64, step=16),
        "model.init_args.dropout": FloatDistribution(0.0, 0.3),
        "data.init_args.batch_size": CategoricalDistribution([32, 64, 128]),
    }


@pytest.mark.parametrize(("entry", "message"), [
    ("{type: gaussian, low: 0, high: 1}", "a: type 'gaussian' is not one of float, int, categorical"),
    ("{type: float, low: 1, high: 0.5}", "a: low must be below high, got low=1, high=0.5"),
    ("{type: float, low: 0, high: 1, log: true}", "a: log: true needs low > 0, got low=0"),
    ("{type: float, high: 1}", "a: low is required for type float"),
    ("{type: int, low: 1.5, high: 4}", "a: low must be an integer, got 1.5"),
    ("{type: float, low: 0.1, high: 1, log: true, step: 0.1}", "a: step and log: true cannot be combined"),
    ("{type: float, low: 0, high: 1, scale: 2}", "a: unknown field(s) scale for type float"),
    ("{type: categorical, choices: []}", "a: choices must be a non-empty list, got []"),
    ("[1, 1]", "a: choices [1, 1] repeat a value"),
    ("0.5", "a: expected a mapping with type: float|int|categorical (or a list of choices), got 0.5"),
])
def test_a_bad_distribution_is_a_usage_error_naming_the_key(tmp_path: Path, entry: str, message: str) -> None:
    path = space_file(tmp_path, f"a: {entry}\n")
    with pytest.raises(UsageError) as err:
        load_space(path)
    assert str(err.value).startswith(f"--space {path}: {message}")


def test_overrides_are_written_as_the_fit_cli_reads_them() -> None:
    assert override_args({"a.b": 0.001, "c": 64, "d": True, "e": None, "f": "x"}) == [
        "--a.b", "0.001", "--c", "64", "--d", "true", "--e", "null", "--f", "x"]


def test_enqueued_parameters_must_be_keys_of_the_space_inside_their_ranges() -> None:
    space = {LR: FloatDistribution(1e-4, 1e-1, log=True), "w": IntDistribution(16, 64)}
    check_fixed(space, {LR: 0.01, "w": 32}, "--enqueue #1")
    with pytest.raises(UsageError, match=r"--enqueue #1: 'x' is not a key of the space"):
        check_fixed(space, {"x": 1}, "--enqueue #1")
    with pytest.raises(UsageError, match=r"--enqueue #2: model.init_args.optimizer.init_args.lr=50.0 is outside"):
        check_fixed(space, {LR: 50.0}, "--enqueue #2")
    with pytest.raises(UsageError, match=r"w=32.5 is outside"):
        check_fixed(space, {"w": 32.5}, "--enqueue #3")


# ------------------------------------------------------------------------ bad input: exit 2, before any trial
def run_main(tracked: Path, capsys: pytest.CaptureFixture[str], space_text: str, *args: str) -> tuple[int, str]:
    path = space_file(tracked, space_text)
    code = sweep.main(["--config", str(CONFIGS / "digits.yaml"), "--space", path, "--trials", "2", "--name", "bad",
                       *args])
    err = capsys.readouterr().err
    return code, err


def assert_nothing_started(tracked: Path) -> None:
    assert not (tracked / "runs" / "digits" / "bad" / "study.db").exists()
    client = client_for(tracked)
    exp = client.get_experiment_by_name("digits")
    assert exp is None or client.search_runs([exp.experiment_id]) == []


def test_an_unknown_key_in_the_space_exits_2_naming_it(tracked: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(tracked, capsys, "model.init_args.widht: {type: int, low: 16, high: 64}\n")
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: --space {tracked / 'space.yaml'}: model.init_args.widht: no such parameter ('widht' is not "
        "accepted)"]
    assert_nothing_started(tracked)


def test_a_bad_distribution_exits_2_naming_it(tracked: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(tracked, capsys, f"{LR}: {{type: float, low: 0.1, high: 0.01}}\n")
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: --space {tracked / 'space.yaml'}: {LR}: low must be below high, got low=0.1, high=0.01"]
    assert_nothing_started(tracked)


def test_a_metric_the_recipe_never_logs_exits_2_naming_it(tracked: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(tracked, capsys, f"{LR}: {{type: float, low: 0.001, high: 0.01, log: true}}\n",
                         "--metric", "val/f1")
    assert code == 2
    assert err.strip().splitlines() == [
        "error: --metric val/f1: the recipe's validation never logs it (it logs: val/acc, val/bayes_expected_cost, "
        "val/expected_cost, val/loss)"]
    assert_nothing_started(tracked)


def test_a_space_value_of_the_wrong_type_exits_2_naming_the_choice(tracked: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(tracked, capsys, "data.init_args.batch_size: [32, big]\n")
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: --space {tracked / 'space.yaml'}: data.init_args.batch_size: choice 'big': "
        "data.init_args.batch_size: expected int, got 'big'"]
    assert_nothing_started(tracked)


@pytest.mark.parametrize(("args", "message"), [
    (("--trials", "0"), "error: --trials 0: must be >= 1"),
    (("--name", "a b"), "error: --name 'a b': letters, digits, '.', '_' and '-' only (it names runs and folders)"),
    (("--run_name", "x"), "error: --run_name: the sweep names and resumes its trials itself; drop it"),
    (("--enqueue", "{nope"), "error: --enqueue '{nope': not JSON (Expecting property name enclosed in double quotes)"),
    (("--budget-usd", "-1"), "error: --budget-usd -1.0: must be > 0"),
])
def test_bad_flags_exit_2_in_one_line(tracked: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                      message: str) -> None:
    code, err = run_main(tracked, capsys, f"{LR}: [0.001, 0.01]\n", *args)
    assert code == 2
    assert err.strip().splitlines() == [message]
    assert_nothing_started(tracked)


# --------------------------------------------------------------------------------------------- the study
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}"


SETTINGS = {"metric": "val/acc", "mode": "max"}


def test_a_new_study_holds_exactly_the_trials_waiting_the_first_with_their_fixed_parameters(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    storage = study.open_storage(url)
    created, new = study.open_study(storage, url, "s", "maximize", SETTINGS, 3, [{LR: 0.01}])
    assert new is True
    trials = created.get_trials()
    assert [(t.number, t.state) for t in trials] == [(0, TrialState.WAITING), (1, TrialState.WAITING),
                                                      (2, TrialState.WAITING)]
    assert trials[0].system_attrs["fixed_params"] == {LR: 0.01}
    joined, new = study.open_study(storage, url, "s", "maximize", SETTINGS, 3, [{LR: 0.01}])
    assert new is False and len(joined.get_trials()) == 3
    grown, _ = study.open_study(storage, url, "s", "maximize", SETTINGS, 5, [{LR: 0.01}])
    assert len(grown.get_trials()) == 5 and grown.user_attrs[study.TRIALS_ATTR] == 5


def test_joining_with_other_settings_or_fewer_trials_is_refused(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    storage = study.open_storage(url)
    study.open_study(storage, url, "s", "maximize", SETTINGS, 3, [])
    with pytest.raises(UsageError, match=r"sweep 's' was started with other settings \(metric: \"val/acc\" -> "
                                         r"\"val/loss\"\); relaunch with the original ones"):
        study.open_study(storage, url, "s", "maximize", {**SETTINGS, "metric": "val/loss"}, 3, [])
    with pytest.raises(UsageError, match=r"--trials 2: sweep 's' already plans 3 trials"):
        study.open_study(storage, url, "s", "maximize", SETTINGS, 2, [])


def test_four_claimants_at_once_take_every_trial_exactly_once(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    study.open_study(study.open_storage(url), url, "s", "maximize", SETTINGS, 12, [])
    taken: list[list[int]] = [[] for _ in range(4)]

    def claim_all(index: int) -> None:
        storage = study.open_storage(url)  # its own connection, as another process has
        mine = optuna.load_study(study_name="s", storage=storage)
        while (frozen := study.claim_trial(mine, storage, url)) is not None:
            taken[index].append(frozen.number)

    threads = [threading.Thread(target=claim_all, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    numbers = sorted(n for part in taken for n in part)
    assert numbers == list(range(12))


def test_a_released_trial_is_claimed_again_with_its_parameters(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    storage = study.open_storage(url)
    s, _ = study.open_study(storage, url, "s", "maximize", SETTINGS, 2, [])
    trial = study.claim_trial(s, storage, url, sampler=lambda number: study.make_sampler("tpe", 42, number))
    assert trial is not None and trial.number == 0
    value = trial.suggest_float("x", 0.0, 1.0)
    tid = study.trial_id(storage, s, 0)
    study.release(storage, tid)
    assert storage.get_trial(tid).state == TrialState.WAITING
    # another draw would differ: the stored value is kept
    again = study.claim_trial(s, storage, url, sampler=lambda number: study.make_sampler("tpe", 7, 99))
    assert again is not None and again.number == 0
    assert again.suggest_float("x", 0.0, 1.0) == value
    assert study.claim_trial(s, storage, url).number == 1
    assert study.claim_trial(s, storage, url) is None  # none waiting: no trial is added past --trials
    assert len(s.get_trials()) == 2


def test_a_trial_whose_process_died_is_handed_back_and_a_live_ones_is_not(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    storage = study.open_storage(url)
    s, _ = study.open_study(storage, url, "s", "maximize", SETTINGS, 3, [])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    trials = [study.claim_trial(s, storage, url) for _ in range(3)]
    assert [t.number for t in trials if t is not None] == [0, 1, 2]
    owner = study.owner_token()
    tids = [study.trial_id(storage, s, number) for number in range(3)]
    storage.set_trial_system_attr(tids[0], study.OWNER_ATTR, {**owner, "pid": int(dead.stdout)})
    storage.set_trial_system_attr(tids[1], study.OWNER_ATTR, {**owner, "pid": os.getppid()})
    storage.set_trial_system_attr(tids[2], study.OWNER_ATTR, {"host": "elsewhere", "pid": 1})
    # a dead process on this host: at once, whatever its heartbeat says; live ones and fresh heartbeats stay
    assert study.stale_trials(s, storage, url, stale_after_s=3600, mine=set()) == [0]
    assert [t.state for t in s.get_trials()] == [TrialState.WAITING, TrialState.RUNNING, TrialState.RUNNING]
    time.sleep(2.1)  # Optuna's heartbeat: whole seconds of the database's clock
    study.heartbeat(storage, tids[1])  # trial 1's process still beats; trial 2's (another machine) fell silent
    assert study.stale_trials(s, storage, url, stale_after_s=1, mine=set()) == [2]
    assert study.stale_trials(s, storage, url, stale_after_s=1, mine={1}) == []  # nor is a trial of its own taken
    assert [t.state for t in s.get_trials()] == [TrialState.WAITING, TrialState.RUNNING, TrialState.WAITING]


def test_each_trial_draws_from_its_own_seed() -> None:
    def draw(seed: int, number: int) -> float:
        s = optuna.create_study(sampler=study.make_sampler("tpe", seed, number))
        return s.ask().suggest_float("x", 0.0, 1.0)

    assert draw(42, 0) == draw(42, 0)
    assert len({draw(42, 0), draw(42, 1), draw(43, 0)}) == 3


# ------------------------------------------------------------------------------------------------- money
def fake_run(usd: float, projected: float | None) -> SimpleNamespace:
    metrics = {"cost/usd": usd, **({} if projected is None else {"cost/projected_usd": projected})}
    return SimpleNamespace(data=SimpleNamespace(metrics=metrics))


def test_spent_sums_every_trial_and_pruning_saves_what_the_pruned_runs_still_projected() -> None:
    runs = {0: fake_run(0.50, 0.50), 1: fake_run(0.125, 0.625), 2: fake_run(0.25, None), 3: fake_run(0.0625, 1.0)}
    trials = [SimpleNamespace(number=0, state=TrialState.COMPLETE), SimpleNamespace(number=1, state=TrialState.PRUNED),
              SimpleNamespace(number=2, state=TrialState.PRUNED), SimpleNamespace(number=3, state=TrialState.RUNNING)]
    cash = report.money(runs, trials)
    assert cash.spent_usd == 0.9375
    assert cash.saved_by_pruning_usd == 0.5  # trial 1: 0.625 - 0.125; trial 2 projected nothing
    assert cash.per_trial == {0: (0.5, 0.5), 1: (0.125, 0.625), 2: (0.25, None), 3: (0.0625, 1.0)}


def test_the_settings_a_relaunch_compares_survive_json(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    storage = study.open_storage(url)
    settings = {"overrides": ["--trainer.max_epochs", "1"], "enqueue": [{LR: 0.01}], "seed": 42}
    study.open_study(storage, url, "s", "maximize", settings, 1, [{LR: 0.01}])
    s, created = study.open_study(storage, url, "s", "maximize", json.loads(json.dumps(settings)), 1, [{LR: 0.01}])
    assert created is False and s.user_attrs[study.SETTINGS_ATTR] == settings


# ---------------------------------------------------------------------------------------------- launch files
LAUNCH = CONFIGS / "launch"


def sweep_overrides(args: list[str]) -> list[str]:
    """The trials' overrides of a launch file's sweep command, after checking its own flags."""
    parsed, extra = sweep.parse(args)
    for path in [*parsed.config, parsed.space]:
        assert (CONFIGS.parent / path).is_file(), path
    assert (parsed.trials, parsed.name, parsed.parallel, parsed.budget_usd) == (100, "digits-sweep", 1, 200.0)
    assert parsed.storage in ("$ATSCALE_SWEEP_STORAGE", "$(ATSCALE_SWEEP_STORAGE)")
    return extra


def test_the_slurm_array_runs_eight_tasks_of_the_same_sweep_and_requeues_on_75(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    text = (LAUNCH / "sweep-slurm-array.sbatch").read_text()
    assert "#SBATCH --array=0-7\n" in text and "#SBATCH --signal=USR1@90\n" in text
    command = text.split("srun python -m recipes.sweep ", 1)[1].split('"$@"', 1)[0].replace("\\\n", " ")
    args = [a.strip('"') for a in command.split()]
    monkeypatch.chdir(CONFIGS.parent)
    assert sweep_overrides(args) == ["--cost.instance", "a3-highgpu-1g", "--cost.market", "spot"]
    assert 'if [ "$code" -eq 75 ]; then\n    scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' in text


def test_the_kubernetes_sweep_job_deserializes_and_runs_eight_pods_of_the_same_sweep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    client = pytest.importorskip("kubernetes.client")
    (job,) = [d for d in yaml.safe_load_all((LAUNCH / "sweep-kubernetes-job.yaml").read_text()) if d]
    api = client.ApiClient()
    model = api.deserialize(json.dumps(job), "V1Job", "application/json")
    assert api.sanitize_for_serialization(model) == job  # nothing unknown, nothing mistyped, nothing lost
    assert job["spec"]["parallelism"] == 8 and job["spec"]["completions"] == 8
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "recipes.sweep"]
    rules = {r["action"]: r.get("onExitCodes", {}).get("values") for r in job["spec"]["podFailurePolicy"]["rules"]}
    assert rules["FailJob"] == [2]
    monkeypatch.chdir(CONFIGS.parent)
    assert sweep_overrides(container["args"]) == ["--runs_root", "s3://my-bucket/runs", "--staging_root", "/staging",
                                                  "--cost.instance", "a3-highgpu-1g", "--cost.market", "spot"]


def test_parallel_trials_divide_the_visible_gpus_and_share_when_there_are_fewer(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    import torch

    from recipes.sweep.runner import gpu_slots

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert gpu_slots(2) == ["0,1,2,3", "4,5,6,7"]
    assert gpu_slots(3) == ["0,1", "2,3", "4,5"]
    assert gpu_slots(1) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpu_slots(2) == ["3", "5"]
    assert gpu_slots(4) == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert gpu_slots(2) == []


@pytest.mark.parametrize(("code", "pruned", "reported", "stopping", "state"), [
    (75, False, True, False, "WAITING"),  # saved on a notice of its own
    (75, False, True, True, "WAITING"),
    (-15, False, False, True, "WAITING"),  # our SIGTERM reached it while it was still importing
    (130, False, False, True, "WAITING"),
    (-15, False, False, False, "FAIL"),  # killed by someone else
    (0, True, True, False, "PRUNED"),
    (0, False, True, False, "COMPLETE"),
    (0, False, False, False, "FAIL"),  # it never reported the metric
    (1, False, True, False, "FAIL"),
    (-9, False, True, True, "FAIL"),
])
def test_how_a_trial_process_ended_decides_the_trial_state(code: int, pruned: bool, reported: bool, stopping: bool,
                                                           state: str) -> None:
    from recipes.sweep.runner import outcome

    assert outcome(code, pruned, reported, stopping) == state


def test_eight_sweeps_opening_a_new_sqlite_study_at_once_all_get_it(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    url = sqlite_url(tmp_path)
    barrier = threading.Barrier(8)

    def open_it(_: int) -> str:
        barrier.wait()
        return type(study.open_storage(url)).__name__

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(open_it, range(8))) == ["RDBStorage"] * 8


def test_promote_of_an_unknown_sweep_exits_2_naming_it(tracked: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recipes import promote

    assert promote.main(["--sweep", "nope"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --sweep 'nope': no such sweep in the tracking store (sweeps there: none)."]
    assert promote.main([]) == 2
    assert capsys.readouterr().err == "error: --experiment is required (or --sweep NAME)\n"


def test_a_sqlite_study_whose_tables_another_program_is_creating_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that does not take the study lock (Optuna's dashboard, a notebook's ``load_study``) can create
    the tables at the same moment: sqlite then says "table ... already exists", and the tables are there."""
    from sqlalchemy.exc import OperationalError

    real = optuna.storages.RDBStorage
    attempts: list[str] = []

    def racing(url: str, **kwargs: object) -> optuna.storages.RDBStorage:
        attempts.append(url)
        if len(attempts) == 1:
            real(url)  # the other program wins the race
            raise OperationalError("CREATE TABLE study_directions (...)", {},
                                   Exception("table study_directions already exists"))
        return real(url, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = study.open_storage(url)
    assert len(attempts) == 2 and storage.get_all_studies() == []


def test_the_parent_run_gets_the_sweeps_figures_under_their_stored_names(tmp_path, monkeypatch):
    """What ``_log_parent`` logs, key by key (the names the docs and stored sweeps hold)."""
    from recipes.sweep.runner import Sweep

    logged: dict[str, object] = {}
    client = SimpleNamespace(log_batch=lambda run_id, metrics: logged.update({m.key: m.value for m in metrics}),
                             set_tag=lambda run_id, key, value: logged.update({key: value}),
                             log_artifact=lambda run_id, path: None)
    monkeypatch.setattr(report, "write_csv", lambda study, cash, path: path)
    monkeypatch.setattr(report, "write_plots", lambda study, out_dir: [])
    runner = SimpleNamespace(parent_run_id="p", client=client, args=SimpleNamespace(budget_usd=2.0),
                             budget_stopped=True, study=None, out_dir=tmp_path)
    trials = [SimpleNamespace(state=TrialState.COMPLETE), SimpleNamespace(state=TrialState.PRUNED)]
    best = SimpleNamespace(number=0, value=0.9)
    Sweep._log_parent(runner, trials, report.Money(spent_usd=1.5, saved_by_pruning_usd=0.25), best,
                       SimpleNamespace(info=SimpleNamespace(run_id="r0")), {"lr": 0.7}, "stopped")
    states = {f"sweep/trials_{s.name.lower()}": float(s in (TrialState.COMPLETE, TrialState.PRUNED))
              for s in TrialState}
    assert logged == {"sweep/spent_usd": 1.5, "sweep/saved_by_pruning_usd": 0.25, **states, "sweep/budget_usd": 2.0,
                      "sweep/best_value": 0.9, "sweep/importance/lr": 0.7, "sweep.stopped_by": "budget",
                      "sweep.best_trial": "0", "sweep.best_run_id": "r0"}
