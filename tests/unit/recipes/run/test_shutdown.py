"""recipes.run.shutdown: a rank that joined a gloo group ends with its own exit code, never SIGABRT at exit.

Each case runs two real processes (gloo, loopback). The stress before the end reproduces what a fit
leaves behind: a group still held after ``destroy_process_group`` (as FSDP2's mesh info and DDP's
reducer hold it) and gloo worker threads still busy with the last collectives. Ended by a normal
interpreter exit, such a pair aborts in most runs on this machine ("terminate called without an
active exception", SIGABRT: 7 runs in 8 when this test was written).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recipes.soak.launch import EXIT_WATCH_LINE, hung_where
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[4]

RANK_SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from recipes.run.shutdown import destroy_process_group, run_and_exit

    CASE, OUT, RANK = sys.argv[1], Path(sys.argv[2]), int(os.environ["RANK"])

    def later() -> None:  # a non-daemon thread still running when main returns: a normal exit waits for it
        time.sleep(0.3)
        (OUT / f"thread{RANK}").write_text("joined")

    class Finalized:  # the interpreter's finalization (clearing module globals) runs this; os._exit does not
        def __init__(self, path: str) -> None:
            # all on the instance: by the time this runs, module globals and builtins may be gone
            self.path, self.flags, self.os = path, os.O_WRONLY | os.O_CREAT, (os.open, os.write, os.close)

        def __del__(self) -> None:
            open_, write, close = self.os
            fd = open_(self.path, self.flags)
            write(fd, b"yes")
            close(fd)

    def main() -> int:
        print(f"rank {RANK} done", flush=False)  # flushed by the exit, not here
        if CASE in ("alone", "group of one", "alone, profiled"):
            if CASE == "group of one":
                dist.init_process_group("gloo")
            atexit.register(lambda: (OUT / f"atexit{RANK}").write_text("ran"))
            threading.Thread(target=later).start()
            global FINALIZED
            FINALIZED = Finalized(str(OUT / f"finalized{RANK}"))
            if CASE == "alone, profiled":
                sys.setprofile(lambda *args: None)  # as python -m cProfile watches a program
            return 7
        dist.init_process_group("gloo")
        global HELD
        HELD = dist.group.WORLD  # as FSDP's mesh info holds it past destroy_process_group
        for _ in range(50):  # collectives left to gloo's worker threads, as a fit's last steps leave them
            dist.all_reduce(torch.ones(100_000), async_op=True)
        dist.all_reduce(torch.ones(1))
        if CASE == "fails":
            raise RuntimeError(f"boom on rank {RANK}")
        destroy_process_group()
        return 7  # at once: what makes the abort likely is exiting while gloo's threads are still busy

    run_and_exit(main)
""")


def run_pair(tmp_path: Path, case: str, world_size: int = 2) -> list[subprocess.CompletedProcess]:
    """Both ranks of ``case`` to the end; each one's exit code, stdout and stderr."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, str(script), case, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.mark.parametrize("attempt", range(3))
def test_a_rank_that_held_its_group_past_destroy_exits_with_its_code(tmp_path: Path, attempt: int) -> None:
    for rank, result in enumerate(run_pair(tmp_path, "succeeds")):
        assert "terminate called" not in result.stderr, result.stderr
        assert result.returncode == 7, f"rank {rank}: exit {result.returncode}\n{result.stderr}"
        assert result.stdout == f"rank {rank} done\n"


def test_a_rank_that_fails_exits_1_with_its_traceback(tmp_path: Path) -> None:
    for rank, result in enumerate(run_pair(tmp_path, "fails")):
        assert "terminate called" not in result.stderr, result.stderr
        assert result.returncode == 1, f"rank {rank}: exit {result.returncode}\n{result.stderr}"
        assert result.stderr.rstrip().endswith(f"RuntimeError: boom on rank {rank}"), result.stderr
        assert "Traceback (most recent call last)" in result.stderr


@pytest.mark.parametrize("case", ["group of one", "alone", "alone, profiled"])
def test_what_a_normal_exit_runs_first_still_runs(tmp_path: Path, case: str) -> None:
    """Threads joined, then atexit handlers, then streams flushed, with a group or without; the finalization
    after them is skipped (seconds after a fit), except under a profiler, which writes its output there."""
    (result,) = run_pair(tmp_path, case, world_size=1)
    assert (result.returncode, result.stdout) == (7, "rank 0 done\n"), result.stderr
    assert (tmp_path / "thread0").read_text() == "joined"
    assert (tmp_path / "atexit0").read_text() == "ran"
    assert (tmp_path / "finalized0").exists() == (case == "alone, profiled")


HANG_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading
    from recipes.run.shutdown import run_and_exit

    def stuck_writer() -> None:  # a non-daemon thread that never ends: the interpreter's exit would wait forever
        threading.Event().wait()

    def main() -> int:
        if sys.argv[1] == "thread":
            threading.Thread(target=stuck_writer, name="stuck-writer").start()
        else:
            atexit.register(threading.Event().wait)  # an exit handler that never returns
        print("main done", flush=True)
        return 75

    run_and_exit(main)
""")


@pytest.mark.parametrize("where", ["thread", "atexit"])
def test_an_exit_that_hangs_ends_with_its_code_and_says_where(tmp_path: Path, where: str) -> None:
    """Past ATSCALE_EXIT_TIMEOUT_S the process ends anyway, with the exit code already decided (75: relaunch),
    after printing where each thread was: a spot run must not outlive its notice waiting on a stuck thread."""
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ATSCALE_EXIT_TIMEOUT_S": "2"}
    result = subprocess.run([sys.executable, str(script), where], env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (75, "main done\n"), result.stderr
    assert "error: the process did not finish exiting within 2 s; where its threads were:" in result.stderr
    assert ("in stuck_writer" if where == "thread" else "in wait") in result.stderr
    assert EXIT_WATCH_LINE in result.stderr  # what the chaos soak looks for, and reads the stacks of
    assert ("stuck_writer" if where == "thread" else "in wait") in hung_where(result.stderr)
    assert result.stderr.rstrip().endswith("Ending it with exit code 75."), result.stderr


def test_a_bad_exit_timeout_is_named(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT.replace('sys.argv[1] == "thread"', "False").replace(
        "atexit.register(threading.Event().wait)", "pass"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "ATSCALE_EXIT_TIMEOUT_S": "soon"}
    result = subprocess.run([sys.executable, str(script), "x"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 75
    assert "ATSCALE_EXIT_TIMEOUT_S='soon' is not a number of seconds; using 120" in result.stderr
