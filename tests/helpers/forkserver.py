"""A warm interpreter that forks one fresh process per `python train.py ...` a test runs.

Most of a short run's CPU time is imports: torch, Hydra and trainflow at start, torch._dynamo at the first optimizer
step, Hydra's plugin scan (a tiny run: 9-10 CPU-seconds as a fresh process, 1.8 forked from this server). The
server imports them once; each run is then a real child process of its own (`os.fork`), with its own argv,
working directory, environment, stdout, stderr and exit code, running `train.py` as `python train.py` would: the
same `__main__`, `sys.argv`, `sys.path[0]` and interpreter shutdown (threads joined, atexit handlers, flushed
streams). trainflow's own local launcher forks its CPU workers the same way.

What cannot be forked is run the ordinary way (`processes.run_process` decides): another command than a script of
this interpreter (`python x.py` or a console script such as `trainflow`), an environment that differs from the
server's in a variable read at import time (OMP_NUM_THREADS, HOME, ...), or a PYTHONPATH folder that would act at
start-up (a sitecustomize) or hide a module the server imported.

Protocol (one line of JSON each way, one request at a time): the server says {"ready": true, "modules": [the
top-level modules it imported]}; the client sends {argv, path (the PYTHONPATH folders the run adds), cwd, env, out,
err, append}; the server answers {"pid": N} once the child exists and {"code": N} once it has ended. A request with
a `status` path is a run started in the background (`subprocess.Popen`): the server answers {"pid": N} only, and
the run's exit code is written to that file when it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

# Variables a run may set without leaving the warm interpreter: each is read when trainflow runs, not at import.
RUNTIME_VARIABLES = frozenset({
    "PYTHONUNBUFFERED", "HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT",
})


def _child(request: dict) -> None:
    """In the forked process: become `python <script> <args>` and end as that interpreter would."""
    import runpy
    import threading
    import traceback

    os.setpgid(0, 0)  # its own process group: a timeout kills the run and whatever it started, not the server
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
    out = os.open(request["out"], mode, 0o644)
    err = os.dup(out) if request["err"] == request["out"] else os.open(request["err"], mode, 0o644)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams, closed by its exit)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    script, *args = request["argv"]
    sys.argv = [script, *args]
    sys.orig_argv = [sys.executable, script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    sys.path[1:1] = request["path"]  # where PYTHONPATH's folders stand in a fresh interpreter: after the script's
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # what the interpreter prints for an uncaught exception, and its exit code
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:  # the interpreter's own shutdown order: join non-daemon threads, run atexit handlers, flush
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)


def serve() -> None:
    """Import what every run imports, then fork a child per request until stdin closes."""
    import hydra  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (torch imports it at a run's first optimizer step: 1.2 s of a 3 s run)
    from hydra.core.plugins import Plugins

    import trainflow.cli  # noqa: F401
    import trainflow.report.runs  # noqa: F401  (the summary of every run)
    import trainflow.run.launch  # noqa: F401  (imports trainflow.run.training and the loop's modules)

    Plugins.instance()  # Hydra's scan of its plugins (our launchers, the Optuna sweeper), done at every start

    answers = sys.stdout
    imported = sorted({name.split(".")[0] for name in sys.modules})
    print(json.dumps({"ready": True, "modules": imported}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        _reap_keepers()
        if "status" in request:
            print(json.dumps({"pid": _start_kept(request)}), file=answers, flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


def _start_kept(request: dict) -> int:
    """A run the client does not wait for: a keeper process forks it, waits for it and writes its exit code to the
    request's status file, so that the server takes the next request at once. Returns the run's pid."""
    read, write = os.pipe()
    keeper = os.fork()
    if keeper == 0:
        os.close(read)
        quiet = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1):  # off the server's pipes: the client reads the server's answers only
            os.dup2(quiet, target)
        pid = os.fork()
        if pid == 0:
            os.close(write)
            _child(request)
        os.write(write, f"{pid}\n".encode())
        os.close(write)
        _, status = os.waitpid(pid, 0)
        written = request["status"] + ".part"
        with open(written, "w") as out:
            out.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(written, request["status"])  # whole or absent: the client polls for it
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        return int(answer.readline())


def _reap_keepers() -> None:
    """Collect the keepers that ended (no run is waited on while a request is read)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


if __name__ == "__main__":
    serve()
