"""What a relaunch may change in the data section (``recipes.run.context.DATA_SETTINGS``), and what it may not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from jsonargparse import Namespace

from recipes.run.common import UsageError
from recipes.run.context import DATA_SETTINGS, flatten, refuse_ignored_changes, refused_changes

#: The params a streamed digits run logged at its first launch (``flatten`` of its config, the data section).
LOGGED = {"experiment": "digits", "data.class_path": "datamodules.streaming.StreamedImageDataModule",
          "data.init_args.url": "s3://bkt/ds", "data.init_args.batch_size": "32", "data.init_args.shuffle_seed": "0",
          "data.init_args.num_workers": "0", "data.init_args.cache_dir": "data/cache/stream",
          "data.init_args.max_cache_size": "25GB", "data.init_args.read_timeout_s": "120.0",
          "data.init_args.download": "True", "data.init_args.fetch_ahead": "1"}


class OneRun:
    """The part of ``MlflowClient`` the check reads: one run's logged params."""

    def get_run(self, run_id: str) -> SimpleNamespace:
        return SimpleNamespace(data=SimpleNamespace(params=LOGGED))


def relaunch(**data: object) -> Namespace:
    """The relaunch's config: the logged one with ``data`` changed."""
    init = {k.removeprefix("data.init_args."): v for k, v in LOGGED.items() if k.startswith("data.init_args.")}
    return Namespace(experiment="digits", data=Namespace(class_path=LOGGED["data.class_path"],
                                                         init_args=Namespace(**{**init, **data})))


def test_the_settings_a_relaunch_may_change_are_the_ones_that_hold_no_training_state() -> None:
    assert DATA_SETTINGS == ("data.init_args.num_workers", "data.init_args.cache_dir", "data.init_args.max_cache_size",
                             "data.init_args.read_timeout_s", "data.init_args.download", "data.init_args.fetch_ahead")


def test_a_relaunch_with_another_cache_timeout_budget_and_workers_resumes() -> None:
    changed = relaunch(num_workers=2, cache_dir="/mnt/other", max_cache_size="1GB", read_timeout_s=600.0,
                       download=False, fetch_ahead=0)
    assert refused_changes(LOGGED, flatten(changed)) == []
    assert refuse_ignored_changes(OneRun(), "r1", changed, "w", "runs/digits/w/checkpoints/step=00000006.ckpt") == "r1"


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("batch_size", 64, "data.init_args.batch_size (32 -> 64)"),
    ("shuffle_seed", 1, "data.init_args.shuffle_seed (0 -> 1)"),
    ("url", "s3://bkt/other", "data.init_args.url (s3://bkt/ds -> s3://bkt/other)"),
])
def test_a_relaunch_that_changes_what_the_data_is_or_its_order_is_still_refused(key: str, value: object,
                                                                                 shown: str) -> None:
    changed = relaunch(num_workers=2, **{key: value})  # beside an allowed change, named alone
    with pytest.raises(UsageError) as refused:
        refuse_ignored_changes(OneRun(), "r1", changed, "w", "runs/digits/w/checkpoints/step=00000006.ckpt")
    assert str(refused.value) == (
        f"run digits/w was started with another config; resuming would keep the checkpoint's training state and "
        f"ignore: {shown}. Relaunch with the original values, or start over with --fresh true or a new --run_name.")
