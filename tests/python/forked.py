"""A worker that reports what it is, for tests/forkserver.rs: run as a
script or with -m, forked from the preloaded server or started afresh.

Each rank writes $FORKED_OUT/rank<RANK>.json: its __name__, sys.argv,
sys.path[0], parent, process group, OOM score, stdin, what
/proc/self/cmdline and /proc/self/environ show, and whether the module
the server preloads (xml.dom.minidom, which nothing here imports) was
there before it ran. It then prints a line to each stream, and rank 1
exits with $FORKED_EXIT.
"""

import json
import os
import sys

preloaded = "xml.dom.minidom" in sys.modules
rank = os.environ["RANK"]


def proc(name):
    with open(f"/proc/self/{name}", "rb") as f:
        return [x.decode() for x in f.read().split(b"\0") if x]


report = {
    "name": __name__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "file": os.path.realpath(__file__),
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "pgid": os.getpgid(0),
    "oom_score_adj": open("/proc/self/oom_score_adj").read().strip(),
    "stdin": os.readlink("/proc/self/fd/0"),
    "cmdline": proc("cmdline"),
    "environ": proc("environ"),
    "preloaded": preloaded,
}
with open(os.path.join(os.environ["FORKED_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
print(f"hello from rank {rank}", flush=True)
print(f"warning from rank {rank}", file=sys.stderr, flush=True)
sys.exit(int(os.environ.get("FORKED_EXIT", "0")) if rank == "1" else 0)
