"""A fork server for judge workers and suite jobs: torch and torch.compile's machinery imported once, each child a
fresh fork.

A judge worker started with `python -m` spends about 3 s importing torch and 6 s importing torch._dynamo (measured
on the H100 host, `stage_s.compiler_import`) before it judges anything; an optimizer judges one to four files per
problem, a suite hundreds (and each suite problem's own job process imports the same before capturing it). The
zygote process imports all of that once, never touching CUDA, and forks one child per request: the child is still
a process of its own (its own session and process group, killed as a whole on time out; a candidate's crash,
patching or CUDA state dies with it), it only starts warm. It sets the request's environment and working folder,
sends its output to the log file, and runs the module as `python -m` would (MODULES only).

    python -m kernelfuse.judge.zygote SOCKET     (kernelfuse.judge.runner starts it; KERNELFUSE_ZYGOTE names it)

Protocol, one Unix-socket connection per child: the client sends one JSON line {module, argv, cwd, env, log}; the server
answers {"pid": N} once forked, then {"returncode": R} when the child has ended (negative: killed by a signal).
A server that cannot start (its imports touched CUDA, say) leaves SOCKET.failed, and the judge spawns its workers.
The server runs no Python threads of its own (a fork from a threaded process can inherit a held lock; torch's
import leaves one idle native thread, which Python 3.12 warns about at each fork) and exits when its parent does.
A child that hung on an inherited lock would end at its time limit as a `timeout` record, never as a verdict.
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import sys
import warnings
from pathlib import Path

from kernelfuse.judge.runner import kill_group

MODULES = ("kernelfuse.judge.worker", "kernelfuse.suite.job")  # what a child may run


def _preload() -> None:
    """Everything a judge worker imports before it judges, CUDA left uninitialised (a forked child cannot use a
    CUDA driver its parent started)."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() through NVML: no CUDA runtime
    import torch

    import kernelfuse.judge.worker as worker
    import kernelfuse.pipeline  # noqa: F401 - what a suite job imports to capture, plan and emit

    worker._prewarm_compiler()
    # children that could not use a GPU that is there: leave, the judge spawns its workers (without a GPU a child
    # never asks for CUDA, and torch marks it bad whenever it found no NVML to count devices with)
    if torch.cuda.is_initialized() or (_children_in_bad_fork() and torch.cuda.is_available()):
        raise SystemExit("kernelfuse zygote: importing the judge touched CUDA; workers will be spawned instead")


def _children_in_bad_fork() -> bool:
    """Would a forked child find CUDA poisoned? torch marks every child bad once its parent has asked the CUDA
    runtime anything (a device count, say); ask a child."""
    import torch

    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0


def _child(request: dict, listener: socket.socket, conn: socket.socket) -> None:
    """In the forked child: become the process the request describes; never returns."""
    code = 1
    try:
        listener.close()
        conn.close()
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if request["module"] not in MODULES:
            raise ValueError(f"{request['module']} is not one of {MODULES}")
        sys.argv = list(request["argv"])
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package")  # preloaded
        code = 0
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)  # the worker leaves by os._exit
    except SystemExit as done:  # the job's sys.exit(main(...))
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException as err:  # noqa: BLE001 - report, then leave without running the server's code
        print(f"kernelfuse zygote: the forked {request.get('module')} failed: {type(err).__name__}: {err}",
              file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    """Accept requests on the Unix socket `path` until the parent process is gone."""
    _preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while os.getppid() == parent:
        for _ in selector.select(timeout=0.2):
            conn, _ = listener.accept()
            try:
                request = json.loads(conn.makefile("r").readline())
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, listener, conn)
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
            children[pid] = conn
        _reap(children)
    for pid in children:
        kill_group(pid)


def _reap(children: dict[int, socket.socket]) -> None:
    """Report the children that have ended to their clients."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            continue
        conn = children.pop(pid)
        try:
            conn.sendall((json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())
        except OSError:
            pass
        conn.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        serve(str(path))
    except BaseException:
        Path(f"{path}.failed").touch()  # clients stop waiting for it and spawn their workers
        raise
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
