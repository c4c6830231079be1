"""A relaunch may change what holds no training state (``recipes.run.context.DATA_SETTINGS``), and resumes exactly.

The loader's resume state is the global sample cursor of :class:`datamodules.loaders.PassSampler`, which does not
depend on how many worker processes fetch the samples, nor on where the fetched chunks are kept. Streamed digits
(prepared into a moto S3 bucket) stopped by a fire drill (exit 75) with no workers, its chunk cache then lost, and
relaunched with 2 workers, another cache directory, read timeout and cache budget: the relaunch resumes, says so in
one line, records the changes as ``config_changed`` tags, and ends bitwise equal to an uninterrupted run. The
elastic relaunch (2 DDP ranks stopped, 1 process with 2 workers relaunched) trains every sample of the epoch once.
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import pytest

from callbacks.spot import REQUEUE_EXIT_CODE
from datamodules.digits import DigitsDataModule
from recipes import prepare
from tests.conftest import CONFIGS, FAST, assert_bitwise_equal, cli_env, final_weights, run_fit, runs_of
from tests.sample_trace import epoch_counts, split_counts
from tests.servers import S3Server, moto_s3  # noqa: F401 - fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600, func_only=True)]

#: One epoch of the digits recipe: 45 steps on one device, 23 on 2 DDP ranks.
DIGITS = ("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false", "--trainer.max_epochs", "1")
#: The relaunch's one line about its changes (the drill, a setting of the first launch alone, is one of them).
NOTE = ("Resumed with a changed config: data.init_args.num_workers, data.init_args.cache_dir, "
        "data.init_args.max_cache_size, data.init_args.read_timeout_s, spot.drill_steps (recorded as "
        "config_changed.* tags).")


@pytest.fixture(scope="module")
def prepared(moto_s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``s3://atscale-relaunch/digits``: 300 training and 75 validation digits in chunks of 32 (10 steps an epoch)."""
    url = f"s3://{moto_s3.make_bucket('atscale-relaunch')}/digits"
    with pytest.MonkeyPatch.context() as patch:
        for key, value in moto_s3.env.items():
            patch.setenv(key, value)
        patch.chdir(tmp_path_factory.mktemp("prepare"))
        assert prepare.main(["digits", "--output", url, "--chunk_items", "32", "--max_items", "300"]) == 0
    return url


def streamed(url: str, cache: Path, *args: str) -> tuple[str, ...]:
    """Two epochs (20 steps) of the streamed digits recipe from ``url``, its chunks kept in ``cache``."""
    return ("--config", str(CONFIGS / "digits-stream.yaml"), *FAST, "--log_model", "false", "--trainer.max_epochs",
            "2", "--data.url", url, "--data.cache_dir", str(cache), "--run_name", "w", *args)


def test_a_relaunch_with_other_workers_cache_and_timeout_resumes_bitwise(prepared: str, moto_s3: S3Server,
                                                                         tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    run_fit(reference, *streamed(prepared, reference / "cache"), env=cli_env(reference, **moto_s3.env), check=True)
    env = cli_env(tmp_path, **moto_s3.env)
    stopped = run_fit(tmp_path, *streamed(prepared, tmp_path / "disk1", "--spot.drill_steps", "[6]"), env=env)
    assert stopped.returncode == REQUEUE_EXIT_CODE, stopped.stderr[-3000:]
    shutil.rmtree(tmp_path / "disk1")  # the cache disk failed
    resumed = run_fit(tmp_path, *streamed(prepared, tmp_path / "disk2", "--data.num_workers", "2",
                                          "--data.read_timeout_s", "30", "--data.max_cache_size", "1GB"), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("Resuming from runs/digits-stream/w/checkpoints/step=00000006.ckpt (step 6).") == 1
    assert resumed.stderr.count(NOTE) == 1
    assert_bitwise_equal(final_weights(tmp_path, "w", "digits-stream"), final_weights(reference, "w", "digits-stream"))
    (run,) = runs_of(tmp_path, "digits-stream")
    assert (run.info.status, run.data.params["data.init_args.num_workers"]) == ("FINISHED", "0")
    assert {k: v for k, v in run.data.tags.items() if k.startswith("config_changed.data")} == {
        "config_changed.data.init_args.num_workers": "2",
        "config_changed.data.init_args.cache_dir": str(tmp_path / "disk2"),
        "config_changed.data.init_args.max_cache_size": "1GB",
        "config_changed.data.init_args.read_timeout_s": "30.0"}


def test_an_elastic_relaunch_with_loader_workers_trains_each_sample_once(tmp_path: Path) -> None:
    traced = (*DIGITS, "--trainer.callbacks+=tests.sample_trace.SampleTrace",
              f"--trainer.callbacks.path={tmp_path / 'trace'}", "--run_name", "el")
    stopped = run_fit(tmp_path, *traced, "--config", str(CONFIGS / "strategy/ddp.yaml"), "--spot.drill_steps", "[12]")
    assert stopped.returncode == REQUEUE_EXIT_CODE, stopped.stderr[-3000:]
    resumed = run_fit(tmp_path, *traced, "--trainer.devices", "1", "--trainer.strategy", "auto",
                      "--data.num_workers", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("Resumed on 1 rank(s) from a checkpoint of 2 (step 12)") == 1
    data = DigitsDataModule()
    data.setup("fit")
    split: collections.Counter = split_counts(data.train_set)
    (seen,) = epoch_counts(tmp_path / "trace").values()
    assert (sum((seen - split).values()), sum((split - seen).values())) == (0, 0)  # none twice, none missed
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FINISHED"
    assert {k: v for k, v in run.data.tags.items() if k.startswith("config_changed.data")} == {
        "config_changed.data.init_args.num_workers": "2"}
