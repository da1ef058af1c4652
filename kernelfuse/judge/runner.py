"""Run a judge worker (or a suite job) in a child process with a wall-clock limit; kill its whole process group
when time is up.

The child runs in a new session, so the compiler processes of an extension build and anything the candidate spawns
are in its process group: one `killpg` ends them all. It is also killed after a normal exit, in case the candidate
left a process behind. Within `judge_zygote()` the child is forked from a warm fork server (kernelfuse.judge.zygote)
instead of started with `python -m`: the same module in its own session, without ~9 s of imports; where the server
cannot be reached, the child is started as before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kernelfuse
from kernelfuse.judge.protocol import read_outcome

KILL_WAIT_S = 60.0
ZYGOTE_ENV = "KERNELFUSE_ZYGOTE"  # "PID:SOCKET" of the fork server the children come from
NO_ZYGOTE_ENV = "KERNELFUSE_NO_ZYGOTE"  # set (to anything) to start every worker with `python -m`
ZYGOTE_START_S = 180.0  # how long a first request waits for the server to finish its imports


@dataclass(frozen=True)
class ChildRun:
    """How the child ended: exit status (negative: signal), whether the judge killed it, and what it reported."""

    returncode: int | None
    timed_out: bool
    wall_s: float
    log_path: Path
    outcome: dict[str, Any] = field(default_factory=dict)
    started: str = "spawned"  # "forked" from the zygote, or "spawned" with python -m


def package_root() -> Path:
    """The folder that holds the `kernelfuse` package (put on the child's PYTHONPATH)."""
    return Path(kernelfuse.__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """The parent's environment plus the package root on PYTHONPATH, unbuffered output and faulthandler."""
    env = dict(os.environ)
    root = str(package_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def kill_group(pid: int) -> None:
    """SIGKILL to the process group `pid` leads (a child started in its own session), if it is still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_worker(request_path: Path, outcome_path: Path, log_path: Path, timeout_s: float) -> ChildRun:
    """Run the worker on REQUEST (forked from the zygote where one is up, else `python -m
    kernelfuse.judge.worker REQUEST`), wait at most `timeout_s`, and collect its outcome."""
    env = child_env()
    env.pop(ZYGOTE_ENV, None)  # a worker has no business with the server
    start = time.monotonic()
    ended = run_module("kernelfuse.judge.worker", [str(request_path)], request_path.parent, env, log_path, timeout_s)
    return ChildRun(ended.returncode, ended.timed_out, time.monotonic() - start, log_path, read_outcome(outcome_path),
                    ended.started)


@dataclass(frozen=True)
class Ended:
    """How a child process ended: exit status (negative: a signal; None: unknown), whether it was killed at its
    limit, and how it was started ("forked" from the zygote or "spawned" with python -m)."""

    returncode: int | None
    timed_out: bool
    started: str


def run_module(module: str, args: list[str], cwd: Path, env: dict[str, str], log_path: Path, timeout_s: float,
               on_start: Callable[[int], None] = lambda pid: None) -> Ended:
    """`python -m MODULE ARGS...` in its own session with output to `log_path`, forked from the zygote where one
    is up; killed with its whole process group after `timeout_s` and again once ended (whatever it left running).
    `on_start(pid)` is told the process group as soon as it exists (to kill it from elsewhere)."""
    server = os.environ.get(ZYGOTE_ENV)
    forked = _Forked.start(server, module, args, cwd, env, log_path) if server else None
    if forked is not None:
        on_start(forked.pid)
        try:
            return Ended(*forked.wait(timeout_s), "forked")
        finally:
            kill_group(forked.pid)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, cwd=str(cwd), env=env, start_new_session=True)
    on_start(proc.pid)
    timed_out = False
    try:
        returncode: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        try:
            returncode = proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            returncode = None
    finally:
        kill_group(proc.pid)
    return Ended(returncode, timed_out, "spawned")


class _Forked:
    """A child forked by the zygote: its process group, and the connection that reports its exit status."""

    def __init__(self, pid: int, lines: _Lines) -> None:
        self.pid, self.lines = pid, lines

    @staticmethod
    def start(server: str, module: str, args: list[str], cwd: Path, env: dict[str, str],
              log_path: Path) -> _Forked | None:
        """Ask the zygote `server` ("PID:SOCKET") for the child; None when it cannot take the request (nothing
        was started then)."""
        conn = _connect(server)
        if conn is None:
            return None
        lines = _Lines(conn)
        try:
            request = {"module": module, "argv": [module, *args], "cwd": str(cwd), "env": env, "log": str(log_path)}
            conn.sendall((json.dumps(request) + "\n").encode())
            return _Forked(int(lines.read(30.0)["pid"]), lines)
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return None

    def wait(self, timeout_s: float) -> tuple[int | None, bool]:
        """(exit status, killed at the limit); None for a status the server could not report."""
        timed_out = False
        try:
            returncode: int | None = int(self.lines.read(timeout_s)["returncode"])
        except TimeoutError:
            timed_out = True
            kill_group(self.pid)
            try:
                returncode = int(self.lines.read(KILL_WAIT_S)["returncode"])
            except (OSError, ValueError, KeyError, TypeError):
                returncode = None
        except (OSError, ValueError, KeyError, TypeError):  # the server died: the child goes with its group
            returncode = None
        self.lines.conn.close()
        return returncode, timed_out


def _connect(server: str) -> socket.socket | None:
    """A connection to the zygote, waiting while it is still importing; None once it is gone or never answers."""
    pid_text, _, path = server.partition(":")
    deadline = time.monotonic() + ZYGOTE_START_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except OSError:
            conn.close()
        failed = Path(f"{path}.failed").exists()  # the server could not start (an exited one may linger as a zombie)
        if failed or time.monotonic() > deadline or not _alive(int(pid_text or 0)):
            return None
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, OverflowError):
        return False
    return pid > 0


class _Lines:
    """JSON lines from a socket, each read with its own time limit (TimeoutError when it passes)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.conn.settimeout(left)
            chunk = self.conn.recv(4096)  # TimeoutError when `left` passes
            if not chunk:
                raise OSError("the zygote closed the connection")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


@contextmanager
def judge_zygote() -> Iterator[None]:
    """Judge workers and suite jobs within the block are forked from one warm server (started here, in the
    background; a block inside another reuses the outer one's). Set KERNELFUSE_NO_ZYGOTE to start each with
    `python -m`."""
    if os.environ.get(ZYGOTE_ENV) or os.environ.get(NO_ZYGOTE_ENV):
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="kernelfuse_zygote_"))
    with open(folder / "zygote.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kernelfuse.judge.zygote", str(folder / "socket")],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
    os.environ[ZYGOTE_ENV] = f"{proc.pid}:{folder / 'socket'}"
    try:
        yield
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
