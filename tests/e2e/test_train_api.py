"""``recipes.train`` driven from a real Jupyter kernel (jupyter_client), as a notebook user drives it.

One kernel for the module: an uninterrupted run, then the same run interrupted with the kernel manager's
``interrupt_kernel`` (a SIGINT, Jupyter's "interrupt kernel") once its first checkpoint is on disk, then the
same cell again. Asserted: the kernel lives and gets its own SIGINT handler back, a good checkpoint is left,
the re-run resumes and ends bitwise equal to the uninterrupted run; bad input is one ``TrainError``; a run
that is running is refused; nothing a launch sets for the process outlives it.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import KernelManager

from callbacks.storage import ckpt_store
from tests.conftest import REPO, assert_bitwise_equal, cli_env, final_weights

pytestmark = pytest.mark.e2e

#: Both runs: 2 epochs (90 steps), a checkpoint every 10 steps (the interrupt waits for the first).
CALL = 'train("configs/digits.yaml", trainer={{"max_epochs": 2}}, spot={{"every_n_steps": 10}}, run_name="{name}")'
#: What the kernel reports of the process state a launch touches.
STATE = """import gc, json, logging, os, signal, torch
print("STATE" + json.dumps({"sigint": repr(signal.getsignal(signal.SIGINT)),
    "sigterm": repr(signal.getsignal(signal.SIGTERM)), "env": dict(os.environ), "threads": torch.get_num_threads(),
    "frozen": gc.get_freeze_count(), "argv": __import__("sys").argv,
    "filters": len(logging.getLogger("lightning.pytorch.utilities.rank_zero").filters)}))"""


class Kernel:
    """A kernel and a client; ``run`` executes code and returns (reply status, stream text, error content)."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(workdir), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def start(self, code: str) -> str:
        return self.kc.execute(code)

    def finish(self, msg_id: str, timeout: float = 300) -> tuple[str, str, dict[str, Any]]:
        text, error = [], {}
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no answer from the kernel in {timeout} s: {''.join(text)[-3000:]}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream":
                text.append(msg["content"]["text"])
            elif kind == "error":
                error = msg["content"]
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                break
        while True:  # the reply to this request (an earlier one's may still be queued)
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]["status"], "".join(text), error

    def run(self, code: str, timeout: float = 300) -> tuple[str, str, dict[str, Any]]:
        return self.finish(self.start(code), timeout)

    def state(self) -> dict[str, Any]:
        status, text, error = self.run(STATE)
        assert status == "ok", error
        return json.loads(text.split("STATE", 1)[1])

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("kernel")
    (workdir / "configs").symlink_to(REPO / "configs")
    k = Kernel(workdir, cli_env(workdir, OMP_NUM_THREADS="1"))
    # the libraries' own import-time settings (torch's, Lightning's, MLflow's environment variables) come first:
    # what a launch sets for the process is what the test compares
    status, _, error = k.run("from recipes import train, TrainError\nimport recipes.run.cli, recipes.run.cell, "
                             "mlflow.pytorch")
    assert status == "ok", error
    k.workdir = workdir  # type: ignore[attr-defined]
    yield k
    k.close()


def test_interrupt_saves_keeps_the_kernel_and_the_rerun_resumes_bitwise(kernel: Kernel) -> None:
    workdir: Path = kernel.workdir  # type: ignore[attr-defined]
    before = kernel.state()
    status, text, error = kernel.run(f"whole = {CALL.format(name='whole')}\nprint(whole.status)")
    assert status == "ok", error
    assert text.rstrip().endswith("finished")
    after = kernel.state()
    # handlers, environment, threads, argv, the collector: all as they were (the first launch adds its log
    # filters once, for good; later launches add none)
    changed = {k: (before["env"].get(k), after["env"].get(k)) for k in {*before["env"], *after["env"]}
               if before["env"].get(k) != after["env"].get(k)}
    assert changed == {}
    assert {k: v for k, v in after.items() if k != "filters"} == {k: v for k, v in before.items() if k != "filters"}

    checkpoints = workdir / "runs" / "digits" / "cut" / "checkpoints"
    cell = f"cut = {CALL.format(name='cut')}\nprint(cut.status)"
    msg_id = kernel.start(cell)
    deadline = time.monotonic() + 240
    while not any(checkpoints.glob("step=*.meta.json")):
        assert time.monotonic() < deadline, "the run wrote no checkpoint"
        time.sleep(0.02)
    kernel.km.interrupt_kernel()  # what Jupyter's "interrupt kernel" does: SIGINT to the kernel
    status, text, error = kernel.finish(msg_id)
    assert status == "ok", error  # train returned: no KeyboardInterrupt in the cell
    assert text.rstrip().endswith("interrupted"), text[-2000:]
    assert "Run the cell again to resume it exactly." in text
    saved = ckpt_store.newest_good(checkpoints, "step=*.ckpt")
    assert saved is not None and 10 <= saved.global_step < 90, saved  # mid-fit, and good
    assert kernel.state() == after  # the kernel lives, with its own SIGINT handler back

    status, text, error = kernel.run(cell)  # the same cell again
    assert status == "ok", error
    assert text.rstrip().endswith("finished")
    assert_bitwise_equal(final_weights(workdir, "cut"), final_weights(workdir, "whole"))
    assert kernel.state() == after
    status, text, error = kernel.run("print(json.dumps([whole.metrics['val/acc'] == cut.metrics['val/acc'], "
                                     "cut.run_id != whole.run_id]))")
    assert status == "ok" and text.strip() == "[true, true]", (text, error)


def test_bad_input_is_one_train_error(kernel: Kernel) -> None:
    status, text, error = kernel.run('train("configs/digits.yaml", trainer={"max_epochz": 3})')
    assert status == "error", text[-3000:]
    assert (error["ename"], error["evalue"]) == ("TrainError", "unrecognized arguments: --trainer.max_epochz=3")
    assert "error:" not in text  # said once, by the exception
    status, _, error = kernel.run('train("configs/digits.yaml", model={"init_args": {"width": -3}})')
    assert (error["ename"], error["evalue"]) == ("TrainError", "ImageClassifier(width=-3) must be >= 1.")
    status, _, error = kernel.run('train("configs/nope.yaml")')
    assert error["ename"] == "TrainError" and error["evalue"].startswith("config file 'configs/nope.yaml' not found")


def test_a_running_run_is_refused(kernel: Kernel) -> None:
    """A second ``train`` of a run that is running (here: held by this kernel, as a run in a thread holds it)."""
    status, _, error = kernel.run(
        "from recipes.run.lock import RunLock\nheld = RunLock('runs/digits/busy'); held.acquire()\n"
        f"try:\n    {CALL.format(name='busy')}\nfinally:\n    held.release()")
    assert status == "error" and error["ename"] == "TrainError", error
    assert error["evalue"].startswith("run digits/busy is already running (host ")
    assert error["evalue"].endswith("wait for it to end, or choose another --run_name.")
