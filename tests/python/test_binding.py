"""The binding's own checks, run by each rank of a ``hatrain-agent launch``.

Registers numpy arrays without a copy, commits, restores older and newer
snapshots byte for byte, and refuses bad input with clear errors. Prints
``binding ok`` at the end; any failed check raises.
"""

import os

import numpy as np

import hatrain


def raises(exc, needle, f, *a, **kw):
    try:
        f(*a, **kw)
    except exc as e:
        assert needle in str(e), f"{exc.__name__} without {needle!r}: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} ({needle!r})")


# Bad registrations are refused before anything reaches the agent.
strided = np.zeros((8, 8), dtype=np.float32)[:, ::2]
raises(ValueError, "not C-contiguous", hatrain.connect, 0, [hatrain.Part("s", strided)])
ro = np.zeros(16, dtype=np.float32)
ro.flags.writeable = False
raises(ValueError, "read-only", hatrain.connect, 0, [hatrain.Part("r", ro)])
raises(ValueError, "cannot be snapshotted", hatrain.connect, 0, [hatrain.Part("c", np.zeros(4, np.complex64))])
raises(TypeError, "numpy array", hatrain.connect, 0, [hatrain.Part("l", [1.0, 2.0])])

# The native module checks what reaches it too.
from hatrain import _native  # noqa: E402

smap = '{"parts": [{"name": "meta", "dtype": "U8", "len": 0}, {"name": "x", "dtype": "F32", "len": 4}]}'
ro_bytes = np.zeros(4, np.float32).view(np.uint8)
ro_bytes.flags.writeable = False
raises(ValueError, "read-only", _native.Runtime.connect, 0, smap, [(ro_bytes, "F32")])
raises(ValueError, "not C-contiguous", _native.Runtime.connect, 0, smap, [(np.zeros(32, np.uint8)[::2], "F32")])
raises(ValueError, "whole number of F32", _native.Runtime.connect, 0, smap, [(np.zeros(6, np.uint8), "F32")])
raises(ValueError, "is not one of", _native.Runtime.connect, 0, smap, [(np.zeros(16, np.uint8), "Q8")])
raises(ValueError, "state map", _native.Runtime.connect, 0, "{not json", [])

# A fault plan's bad entries are refused, saying what is wrong; an entry
# of a STEP range fires once at each step of it.
from hatrain import drill  # noqa: E402

raises(ValueError, "ends before it begins", drill.parse, "1:7-5:forward:kill")
raises(ValueError, "FIRST-LAST", drill.parse, "1:5-:forward:kill")
raises(ValueError, "unknown action", drill.parse, "1:5-7:forward:nap")
plan = drill.Plan(1, "1:5-7:forward:sleep0;0:6:forward:sleep0;1:6:update:sleep0")
for s in range(1, 10):
    plan.hit(s, "forward")
    plan.hit(s, "forward")
assert [e.fired for e in plan.entries] == [{5, 6, 7}, set(), set()], plan.entries

rank = int(os.environ["RANK"])
w = np.arange(1 << 20, dtype=np.float32)
ids = np.arange(100, dtype=np.int64)
half = np.zeros(1000, dtype=np.float16)
base = w.ctypes.data
rt = hatrain.connect(rank, [hatrain.Part("w", w), hatrain.Part("ids", ids), hatrain.Part("half", half)], meta_len=16)
kind, epoch = rt.start
assert kind == "fresh", kind
assert rt.snapshot_bytes == 16 + w.nbytes + ids.nbytes + half.nbytes, rt.snapshot_bytes
assert rt.held() == [(0, w.size), (0, ids.size), (0, half.size)], rt.held()

rt.commit(0, epoch, b"zero", of="start")
before = (w.copy(), ids.copy(), half.copy())
with rt.update(1):
    w += 1.5
    ids *= 3
    half[:] = 0.5
rt.commit(1, epoch, b"one")
after = (w.copy(), ids.copy(), half.copy())

# Restores write the registered arrays in place: same memory, old bytes.
meta = rt.restore(0)
assert meta == b"zero".ljust(16, b"\0"), meta
assert w.ctypes.data == base
for got, want in zip((w, ids, half), before):
    assert np.array_equal(got, want), "restore of step 0"
meta = rt.restore(1)
assert meta.rstrip(b"\0") == b"one"
for got, want in zip((w, ids, half), after):
    assert np.array_equal(got, want), "restore of step 1"

# Three slots (the binding's default): steps 2 and 3 take the place of
# step 0's snapshot, and then of step 1's.
with rt.update(2):
    w[:] = -7
    ids[:] = -7
    half[:] = -7
rt.commit(2, epoch, b"two")
meta = rt.restore(1)
for got, want in zip((w, ids, half), after):
    assert np.array_equal(got, want), "restore of step 1 after step 2"
assert rt.restore(0).rstrip(b"\0") == b"zero"
with rt.update(3):
    w[:] = 9
rt.commit(3, epoch, b"three")
raises(hatrain.HatrainError, "no verified snapshot of step 0", rt.restore, 0)
assert rt.restore(2).rstrip(b"\0") == b"two" and (w == -7).all() and (half == -7).all()
assert rt.restore(3).rstrip(b"\0") == b"three" and (w == 9).all()

# Errors name what is wrong.
raises(hatrain.HatrainError, "no verified snapshot of step 99", rt.restore, 99)
raises(ValueError, "holds 16", rt.commit, 3, epoch, b"x" * 17)
raises(ValueError, "expected", rt.commit, 3, epoch, b"", of="middle")
assert rt.finish(3)

# The job's rendezvous store, through the agent (authenticated under the
# job's secret): what a process group meets in across hosts.
rank = os.environ["RANK"]
store = _native.AgentStore(timeout=10.0)
store.set(f"binding/{rank}", "ab01")
assert store.get(f"binding/{rank}") == "ab01"
assert store.get("binding/never-set", 0.05) is None
first = store.add(f"binding/count/{rank}", 1)
assert store.add(f"binding/count/{rank}", 2) == first + 2
raises(ValueError, "HOST:PORT", _native.AgentStore, "no-port-here")
raises(ValueError, "seconds", _native.AgentStore, None, -1.0)
raises(ValueError, "seconds", store.get, "binding/x", float("nan"))
print("binding ok")
