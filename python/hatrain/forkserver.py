"""The fork server of a job's Python workers (``hatrain-agent launch
--preload MODULES``).

A Python worker spends seconds of its start in imports (``import torch``
and, at the first optimizer, ``torch._dynamo``); a worker restarted after a
fault spends them again. The agent starts this server once per host, with
the worker command's interpreter and interpreter options::

    python [OPTIONS] -m hatrain.forkserver MODULE... -- WORKER-COMMAND...

It imports the modules, says it is ready, and then forks each worker the
agent asks for. A worker starts as a copy of the server, its imports done,
and becomes what ``python [OPTIONS] SCRIPT ARGS`` or ``python [OPTIONS] -m
MODULE ARGS`` would have been: the request's environment, arguments,
output, ``sys.path[0]`` and a fresh ``__main__``. Nothing of the worker's
own runs in the server, so what a module reads from the environment at
import time is read from the server's: the job's, without a rank's own
variables.

A worker's ``/proc/PID/cmdline`` (what ``ps`` shows) is read from the
memory its command came in, which a forked worker has from the server; the
worker writes its own command there, and the agent makes the server's long
enough (the worker command after ``--``). ``/proc/PID/environ`` is read the
same way, but is left as it is: code loaded in the server may keep pointers
into it. It shows the server's starting environment (the job's, without a
rank's variables); ``os.environ`` and ``getenv`` give the worker's.

Protocol: JSON messages on the SOCK_SEQPACKET socket whose descriptor is
``HATRAIN_FORKSERVER_FD``:

- server to agent, once: ``{"ready": true, "seconds": S}``, or
  ``{"error": MESSAGE}`` before it exits;
- agent to server: ``{"script": PATH}`` or ``{"module": NAME}``, with
  ``"args"``, ``"argv"`` (the whole command, for its title), ``"env"`` (``[[KEY, VALUE], ...]``, the whole environment)
  and ``"oom_score_adj"``, and three descriptors as SCM_RIGHTS: the
  worker's stdout and stderr, and a gate;
- server to agent: ``{"pid": PID}`` or ``{"error": MESSAGE}``.

The worker is the agent's child, as if the agent had forked it: the server
forks a go-between, which forks the worker and exits, and the orphan goes
to the agent, a child subreaper (prctl(2)), which reaps it and hears of its
death like any worker's. The go-between puts the worker in a process
group of its own before it tells its pid. The worker waits to be the
agent's, takes the agent as the parent whose death kills it and the
workers' OOM score, and then waits at the gate: the agent writes a byte
there once it has registered the pid (it holds its reaper's lock from the
request until then, so an exit that comes first is not lost), and closes
it unwritten if the fork failed on its side, so that no worker it does not
know of runs.

The server exits when the agent closes the socket, and dies with it.
"""

import ctypes
import json
import os
import signal
import socket
import struct
import sys
import time
import warnings

_PR_SET_PDEATHSIG = 1
# A request and its environment; larger ones are refused.
_MAX_REQUEST = 1 << 22


def _send(sock, **msg):
    sock.send(json.dumps(msg).encode())


def _set_parent_death_signal():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


class _Worker:
    """What a forked worker is to become."""

    def __init__(self, request, fds, agent):
        self.request = request
        self.fds = fds
        self.agent = agent


def _fork_quietly():
    """os.fork(), without the warning Python 3.12 gives at a fork of a
    process with threads (torch's import starts one; the worker's own
    start after the fork)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
        return os.fork()


def _serve(sock, agent):
    """Forks workers until the agent closes the socket. Returns only in a
    worker, with what it is to become."""
    while True:
        try:
            msg, fds, flags, _ = socket.recv_fds(sock, _MAX_REQUEST, 3)
        except InterruptedError:
            continue
        if not msg and not fds:
            sys.exit(0)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError(f"a request of more than {_MAX_REQUEST} bytes or 3 descriptors")
            request = json.loads(msg)
            if len(fds) != 3 or not isinstance(request, dict):
                raise ValueError("a request is a JSON object with the worker's stdout, stderr and gate")
            worker = _fork(sock, request, fds, agent)
        except Exception as e:  # noqa: BLE001: every failure is the agent's to hear of
            for fd in fds:
                os.close(fd)
            _send(sock, error=f"{type(e).__name__}: {e}")
            continue
        if isinstance(worker, _Worker):
            return worker
        for fd in fds:
            os.close(fd)
        _send(sock, pid=worker)


def _fork(sock, request, fds, agent):
    """Forks the worker through a go-between: its pid in the server, a
    `_Worker` in the worker."""
    r, w = os.pipe()
    # Nothing buffered here may be written again by each worker.
    sys.stdout.flush()
    sys.stderr.flush()
    go_between = _fork_quietly()
    if go_between == 0:
        # Neither the go-between nor a worker that fails here ever runs
        # the server's code again.
        try:
            os.close(r)
            pid = _fork_quietly()
            if pid == 0:
                os.close(w)
                sock.close()
                worker = _Worker(request, fds, agent)
            else:
                # Its own group before anyone can signal it by its pid.
                os.setpgid(pid, pid)
                os.write(w, struct.pack("=i", pid))
        except BaseException:
            os._exit(1)
        if pid == 0:
            return worker
        os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 4)
    finally:
        os.close(r)
        os.waitpid(go_between, 0)
    if len(got) != 4:
        raise OSError("the go-between ended before it forked the worker")
    return struct.unpack("=i", got)[0]


def _become(worker):
    """Turns this copy of the server into the requested worker and runs
    it; returns only through its exit."""
    request = worker.request
    # The go-between has exited once the agent is this process's parent.
    deadline = time.monotonic() + 10
    while os.getppid() != worker.agent:
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0002)
    _set_parent_death_signal()
    if os.getppid() != worker.agent:
        # The agent died between the check and the signal.
        os._exit(1)
    stdout, stderr, gate = worker.fds
    # The agent has registered this pid, or gave up on it.
    if os.read(gate, 1) != b"\x01":
        os._exit(1)
    os.close(gate)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(request.get("oom_score_adj", "")))
    except OSError:
        pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, fd in ((1, stdout), (2, stderr)):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update({k: v for k, v in request["env"]})
    argv = [str(a) for a in request.get("argv", [])]
    _retitle(argv)
    sys.orig_argv = argv
    args = [str(a) for a in request.get("args", [])]
    main = _fresh_main()
    if "module" in request:
        import runpy

        sys.argv = [request["module"]] + args
        # What `python -m MODULE` does, in the fresh `__main__`.
        runpy._run_module_as_main(request["module"], alter_argv=True)
        return
    _run_script(main, str(request["script"]), args)


def _fresh_main():
    """A new, empty `__main__` in place of the server's."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    return main


def _retitle(argv):
    """Writes the worker's command over the server's in this process's
    memory, where ``/proc/PID/cmdline`` is read from; left as it was if
    it does not fit."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Fields 48 and 49, counted after the command name's parenthesis.
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, ValueError, IndexError):
        return
    block = b"".join(os.fsencode(a) + b"\0" for a in argv)
    if argv and len(block) <= end - start:
        ctypes.memmove(start, block.ljust(end - start, b"\0"), end - start)


def _run_script(main, path, args):
    """What `python SCRIPT` does: the script's folder first on the path
    (unless -P or -I keeps it off), and its code run in `main`."""
    import importlib.machinery

    sys.argv = [path] + args
    if not getattr(sys.flags, "safe_path", False):
        # The working folder, where `-m hatrain.forkserver` put it.
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    main.__file__ = os.path.abspath(path)
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001: reported as Python would
        # The traceback starts at the script, as `python SCRIPT` prints it.
        sys.excepthook(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


def main():
    fd = os.environ.pop("HATRAIN_FORKSERVER_FD", None)
    if fd is None:
        sys.exit("hatrain.forkserver is started by hatrain-agent (launch --preload), not by hand")
    sock = socket.socket(fileno=int(fd))
    agent = os.getppid()
    # The terminal's Ctrl-C is the agent's to handle, not this server's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    t0 = time.monotonic()
    args = sys.argv[1:]
    modules = args[: args.index("--")] if "--" in args else args
    for name in modules:
        try:
            __import__(name)
        except BaseException as e:  # noqa: BLE001: told to the agent
            _send(sock, error=f"cannot import {name}: {type(e).__name__}: {e}")
            sys.stderr.flush()
            # Not sys.exit: a thread the failed import started must not
            # keep the server alive.
            os._exit(1)
    _send(sock, ready=True, seconds=round(time.monotonic() - t0, 3))
    worker = _serve(sock, agent)
    _become(worker)


if __name__ == "__main__":
    main()
