"""A worker that reports what it is, for tests/forkserver.rs: run as a
script or with -m, forked from the preloaded server or started afresh.

Each rank writes $FORKED_OUT/rank<RANK>.json: its __name__, __file__,
sys.argv, sys.path[0], RANK, parent, process group, OOM score, stdin,
what /proc/self/cmdline shows, any name of the server's in its globals, a
draw of numpy's global generator, and whether the module the server
preloads (xml.dom.minidom, which nothing here imports) was there before
it ran. It then prints a line to each stream, and rank 1 exits with
$FORKED_EXIT.
"""

import json
import os
import sys

preloaded = "xml.dom.minidom" in sys.modules
server_names = sorted(n for n in ("_serve", "_become", "_fork", "_send", "main") if n in globals())

import numpy  # noqa: E402: after the look at what was there before
rank = os.environ["RANK"]


def proc(name):
    with open(f"/proc/self/{name}", "rb") as f:
        return [x.decode() for x in f.read().split(b"\0") if x]


report = {
    "name": __name__,
    "dunder_file": __file__,
    "rank_env": os.environ.get("RANK"),
    "server_names": server_names,
    "numpy_draw": numpy.random.random(),
    "argv": sys.argv,
    "path0": sys.path[0],
    "file": os.path.realpath(__file__),
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "pgid": os.getpgid(0),
    "oom_score_adj": open("/proc/self/oom_score_adj").read().strip(),
    "stdin": os.readlink("/proc/self/fd/0"),
    "cmdline": proc("cmdline"),
    "preloaded": preloaded,
}
with open(os.path.join(os.environ["FORKED_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
print(f"hello from rank {rank}", flush=True)
print(f"warning from rank {rank}", file=sys.stderr, flush=True)
sys.exit(int(os.environ.get("FORKED_EXIT", "0")) if rank == "1" else 0)
