"""What a streamed run's record holds: the MLflow dataset input names the URL and the index digest, and a rerun
pins that digest."""

from __future__ import annotations

import json

from callbacks.manifest import training_input
from recipes.reproduce import rerun_config


class Streamed:
    """A datamodule as the manifest sees a streamed one (``dataset_source``)."""

    def dataset_source(self) -> dict[str, str]:
        return {"url": "s3://bucket/digits", "index_digest": "ab" * 32}


class InMemory:
    pass


def test_streamed_input_is_named_by_its_url_with_the_index_digest() -> None:
    streamed = training_input(Streamed(), "ab" * 32)
    assert (streamed.dataset.name, streamed.dataset.digest, streamed.dataset.source_type) == (
        "s3://bucket/digits", ("ab" * 32)[:36], "litdata")
    assert json.loads(streamed.dataset.source) == {"datamodule": f"{__name__}.Streamed", "url": "s3://bucket/digits",
                                                   "index_digest": "ab" * 32}
    plain = training_input(InMemory(), "cd" * 32)
    assert (plain.dataset.name, plain.dataset.source_type) == ("InMemory", "code")
    assert json.loads(plain.dataset.source) == {"datamodule": f"{__name__}.InMemory"}


def test_a_rerun_of_streamed_data_pins_the_index_digest() -> None:
    data = {"class_path": "datamodules.streaming.StreamingImageDataModule", "init_args": {"url": "s3://b/d"}}
    config = {"data": data, "run_name": "old"}
    rerun = rerun_config(config, "new", None, "ef" * 32)
    assert rerun["data"] == {"class_path": data["class_path"], "init_args": {"url": "s3://b/d",
                                                                             "index_digest": "ef" * 32}}
    assert config["data"]["init_args"] == {"url": "s3://b/d"}  # the record itself is left as it was
    in_memory = {"data": {"class_path": "datamodules.digits.DigitsDataModule", "init_args": {}}}
    assert rerun_config(in_memory, "new", None, "ef" * 32)["data"] == in_memory["data"]
