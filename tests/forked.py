"""``python -m MODULE ARGS`` started as a fork of a process that already imported the heavy libraries.

Most of an end-to-end test's launch is the interpreter importing torch, Lightning, MLflow and their
dependencies (about 5 CPU-seconds of a 7-second one-epoch fit on the 2-core CI machine); the suite starts
a few hundred such processes. A *zygote* (``python -m tests.forked SOCKET``) imports them once, then forks
one child per launch. The child is a real process of its own: its own pid (``os.kill`` and ``os.killpg``
reach it), its own session when asked, its own standard streams, environment and working directory, the
module run as ``__main__`` as ``python -m`` runs it, and the interpreter's normal exit (or the project's
own ``os._exit``). What it skips is only the imports of libraries the zygote preloaded; the project's own
modules (``recipes``, ``callbacks``, ``datamodules``) are imported fresh in each child.

A launch uses the zygote only when nothing that libraries read at import time differs from the zygote's
(``same_import_environment``: OpenMP's thread count and wait policy, ``PYTHON*``, ``TORCH*``, ...);
otherwise, and for any caller that asks for a real interpreter, it starts one (``subprocess``). Real
interpreter starts stay covered: the README's default-recipe runs, the DDP ranks Lightning's launcher starts, the
launch-file tests (bash, torchrun, SLURM scripts) and the tests that change threads or load.

No library does this for arbitrary modules with pass-through file descriptors and exit statuses
(``multiprocessing``'s fork server runs functions, not programs, and reports no signal deaths of
grandchildren), hence these hundred lines.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import random
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: Imported once by the zygote, in the order ``python -m recipes.fit`` first imports them (some configure logging
#: on import: the order decides who adds the handler), minus the project. Not ``mlflow.pytorch``: it imports
#: ``pytorch_lightning`` and configures the root logger, which a launch that logs no model never does. The last
#: four come later in every fit (Lightning's checkpoint-path check imports s3fs, MLflow's run context GitPython and
#: IPython, the baselines scikit-learn's linear models): about 0.4 CPU-seconds a launch. Then what the digits
#: datamodule, the checkpoint reader and the logged model (MLflow saves the network as a ``torch.export`` program)
#: import: about 0.4 more.
PRELOAD = ("mlflow", "torch", "torch._dynamo", "jsonargparse", "lightning.fabric", "lightning.pytorch",
           "lightning.pytorch.cli", "lightning.pytorch.loggers", "torchmetrics", "torchvision", "rich.console",
           "rich.table", "scipy.stats", "sklearn.metrics", "mlflow.store.tracking.sqlalchemy_store",
           "s3fs", "git", "IPython", "sklearn.linear_model",
           "sklearn.datasets", "torch.distributed.checkpoint", "mlflow.pyfunc", "torch.export", "torch.export._trace",
           "torch._export.serde.serialize", "torch._inductor.ir", "sympy.tensor.tensor")

#: Environment read by libraries while they are imported (or by the interpreter at start): a launch whose
#: value differs from the zygote's gets a real interpreter.
IMPORT_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "PYTHON", "LD_",
                        "CUDA", "NCCL", "MPLBACKEND", "MPLCONFIGDIR", "HOME", "PATH", "VIRTUAL_ENV", "TMPDIR",
                        "GIT_PYTHON_", "S3FS_")
#: ...except these, which the interpreter reads per process and the child sets itself.
PER_PROCESS = ("PYTHONUNBUFFERED", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")


def same_import_environment(a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    """Whether a process started with ``a`` would import the preloaded libraries as one started with ``b``."""
    keys = {k for k in (*a, *b) if k.startswith(IMPORT_TIME_PREFIXES) and k not in PER_PROCESS}
    return all(a.get(k) == b.get(k) for k in keys)


# ----------------------------------------------------------------------------------------------- the zygote


def _warm_requirement_check() -> None:
    """Build, once, the map of installed distributions MLflow checks a logged model's requirements against.

    MLflow builds it on a process's first logged model by reading every installed distribution's file list
    (about 1 CPU-second; most launches log a model) and keeps it for the process: made here, forks inherit it.
    It depends only on what is installed, which the zygote's children share. ``warn_dependency_requirement_mismatches``
    is the module-level function MLflow's ``save_model`` calls; torch is installed, so it warns of nothing.
    tests/unit/test_forked.py fails if MLflow stops keeping the map.
    """
    from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

    warn_dependency_requirement_mismatches(["torch"])


def _serve(path: str) -> dict[str, Any]:
    """Preload, then fork a child per request; returns (in the child only) the request it must run."""
    for name in PRELOAD:
        importlib.import_module(name)
    _warm_requirement_check()
    # the preloaded objects leave the garbage collector's generations: a child's collections neither walk them nor
    # touch (copy-on-write) their pages
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)  # the client waits for this line
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that reports its exit
    parent = os.getppid()
    while os.getppid() == parent:  # the test session ended (or died): stop
        if selector.select(timeout=0.05):
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
            request = json.loads(message)
            settled, settled_w = os.pipe()  # the child's session exists before its pid is handed out
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                conn.close()
                os.close(settled)
                if request["new_session"]:
                    os.setsid()
                os.close(settled_w)
                return {**request, "fds": fds}
            os.close(settled_w)
            os.read(settled, 1)  # returns at the child's close: an os.killpg(pid) from now on reaches its group
            os.close(settled)
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:
                conn.send(str(os.waitstatus_to_exitcode(status)).encode())
            except OSError:  # the client is gone
                pass
            conn.close()
    for pid in waiting:
        os.kill(pid, signal.SIGKILL)
    raise SystemExit(0)


def _become(request: dict[str, Any]) -> None:
    """Turn this fork into the requested process (its session is already made): streams, directory, environment,
    signals, argv."""
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    own_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # the zygote's
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGPIPE else signal.SIG_IGN)  # as the interpreter
    # a fresh interpreter seeds these from the OS: forks of one zygote would otherwise all draw the same numbers
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=unbuffered or stream is sys.stderr)
    sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    # as the interpreter sets it: the script's folder (`python FILE`) or the working directory (`python -m`) first
    first = str(Path(request["script"]).resolve().parent) if request["script"] else request["cwd"]
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in extra and p not in own_path]]
    sys.argv = [request["script"] or "-m", *request["args"]]  # runpy puts the module's path in argv[0]


def _exit_code(exit_request: SystemExit) -> int:
    """The exit code ``raise SystemExit(x)`` means, printing ``x`` where the interpreter would."""
    if exit_request.code is None or isinstance(exit_request.code, int):
        return exit_request.code or 0
    print(exit_request.code, file=sys.stderr)
    return 1


def main() -> None:
    request = _serve(sys.argv[1])
    _become(request)
    interrupted = False
    try:
        if request["script"]:
            runpy.run_path(request["script"], run_name="__main__")
        else:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_request:
        code = _exit_code(exit_request)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:  # the program's uncaught exception: reported as the interpreter reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    # The interpreter's exit up to its finalization: non-daemon threads joined, atexit handlers, streams
    # flushed. The finalization itself (tearing down every preloaded module, seconds) is skipped: a new
    # interpreter would tear down only what the program imported. (CPython's private hooks are the only ones.)
    # recipes/run/shutdown.py ends the CLI the same way; it is not imported here: the zygote imports no project
    # module, so that each child imports the project fresh.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as the interpreter ends after an uncaught Ctrl-C: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


# ----------------------------------------------------------------------------------------------- the client


class ForkedProcess:
    """A child of the zygote, with the parts of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, stdout: IO | None, stderr: IO | None):
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr
        self.stdin = None
        self._conn = conn
        self._readers: list[threading.Thread] = []
        self._output: dict[str, Any] = {}

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                reply = self._conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            self.returncode = int(reply) if reply else -signal.SIGKILL  # an empty reply: the zygote died
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read both pipes to their end while the process runs, then wait for it (as ``Popen`` does).

        After a ``TimeoutExpired`` it may be called again (say, after ``kill``): the same readers go on.
        """
        if not self._readers:
            self._readers = [threading.Thread(target=lambda n=name, s=stream: self._output.__setitem__(n, s.read()),
                                              daemon=True)
                             for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream]
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._output.get("stdout"), self._output.get("stderr")

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


class Zygote:
    """One per test process: started on first use, ended with the process (it watches its parent)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._path = ""
        self._env: dict[str, str] = {}

    @property
    def started(self) -> bool:
        return self._proc is not None

    def start(self, env: Mapping[str, str]) -> None:
        """Start the zygote with ``env`` (what it imports under) and wait until it has imported everything."""
        self._env = dict(env)
        # a socket's path is limited to 107 bytes: a short folder, whatever TMPDIR is
        self._path = str(Path(tempfile.mkdtemp(prefix="zygote-", dir="/tmp" if Path("/tmp").is_dir() else None))
                         / "socket")
        repo = str(Path(__file__).resolve().parents[1])
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.forked", self._path], cwd=repo, env=self._env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the launch zygote failed to start (exit {self._proc.wait()})")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def serves(self, env: Mapping[str, str]) -> bool:
        return self._proc is not None and self._proc.poll() is None and same_import_environment(env, self._env)

    def launch(self, module: str | None, args: Sequence[str], *, cwd: Path | str, env: Mapping[str, str],
               script: str | None = None,
               stdout: Any = None, stderr: Any = None, start_new_session: bool = False,
               text: bool = False) -> ForkedProcess:
        """Start ``python -m module args`` (or ``python script args``).

        ``stdout``/``stderr`` as ``Popen`` takes them: None, PIPE, DEVNULL, STDOUT (stderr), a file or descriptor.
        """
        ours: list[int] = []  # descriptors opened here, closed once the zygote has its copies
        parent_ends: dict[str, int] = {}

        def child_end(spec: Any, name: str, default: int) -> int:
            if spec is None:
                return default
            if spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                ours.append(fd)
                return fd
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                parent_ends[name] = read
                ours.append(write)
                return write
            return spec if isinstance(spec, int) else spec.fileno()

        stdin_fd = child_end(subprocess.DEVNULL, "stdin", 0)
        stdout_fd = child_end(stdout, "stdout", 1)
        stderr_fd = stdout_fd if stderr == subprocess.STDOUT else child_end(stderr, "stderr", 2)
        request = {"module": module, "script": script, "args": list(args), "cwd": str(cwd), "env": dict(env),
                   "new_session": start_new_session}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self._path)
            socket.send_fds(conn, [json.dumps(request).encode()], [stdin_fd, stdout_fd, stderr_fd])
            pid = int(conn.recv(64))
        finally:
            for fd in ours:
                os.close(fd)
        streams = {name: open(fd, "r" if text else "rb", closefd=True) for name, fd in parent_ends.items()}
        command = [sys.executable, script] if script else [sys.executable, "-m", module]
        return ForkedProcess([*command, *args], conn, pid, streams.get("stdout"), streams.get("stderr"))


if __name__ == "__main__":
    main()
