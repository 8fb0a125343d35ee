"""The process group's store for a job under hatrain-agent: on one host a
file of the workers' folder; across hosts the agent's rendezvous store,
reached through this host's agent, as a ``torch.distributed.Store``.

The agent hosts the store, never a rank (any rank may be the one that
died), and every frame to and from it is authenticated under the job's
secret, so a process of another user cannot join or read the group. On a
job of several hosts each worker's connection goes through its own agent
to the controller's store, and follows a new controller when one takes
over: each epoch's group opens a connection of its own. Keys are
namespaced by the epoch, so a rebuilt group never reads an older one's.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

import hatrain

from . import _native


def for_epoch(epoch: int, timeout: datetime.timedelta, one_host: bool) -> dist.Store:
    """The store the process group of ``epoch`` meets in, keys of ``epoch``
    only, so that a rebuilt group never reads an older one's: on one host a
    file of the workers' folder, which the agent keeps private; across hosts
    the agent's rendezvous store."""
    folder = os.environ.get("HATRAIN_WORKER_DIR")
    if one_host and folder:
        return dist.FileStore(os.path.join(folder, f"torch-store-epoch-{epoch}"), -1)
    if os.environ.get("HATRAIN_AGENT_STORE"):
        return AgentStore(f"torch/epoch/{epoch}/", timeout)
    raise hatrain.HatrainError(
        "neither HATRAIN_WORKER_DIR (one host) nor HATRAIN_AGENT_STORE (several) is set: "
        "run under a hatrain-agent of this version"
    )


def _text(value) -> str:
    """A value as the store keeps it: bytes in hex."""
    if isinstance(value, str):
        value = value.encode()
    return bytes(value).hex()


class AgentStore(dist.Store):
    """The keys under ``prefix`` of the store at ``address`` (default: this
    host's agent's). ``timeout`` bounds ``get`` and ``wait``, as a
    ``TCPStore``'s does."""

    def __init__(self, prefix: str, timeout: datetime.timedelta, address: str | None = None):
        super().__init__()
        self._prefix = prefix
        self._timeout = timeout
        self._conn = _native.AgentStore(address, timeout=max(timeout.total_seconds(), 1.0))

    def _key(self, key) -> str:
        if isinstance(key, bytes):
            key = key.decode()
        return self._prefix + key

    def set(self, key, value) -> None:
        self._conn.set(self._key(key), _text(value))

    def get(self, key) -> bytes:
        got = self._wait_for(self._key(key), self._timeout)
        return bytes.fromhex(got)

    def add(self, key, value: int) -> int:
        return self._conn.add(self._key(key), int(value))

    def check(self, keys) -> bool:
        return all(self._conn.get(self._key(k), 0.0) is not None for k in keys)

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        for k in keys:
            self._wait_for(self._key(k), timeout or self._timeout)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def compare_set(self, key, expected, desired) -> bytes:
        raise NotImplementedError("the agent's store has no compare-and-set")

    def delete_key(self, key) -> bool:
        raise NotImplementedError("the agent's store keeps every key of an epoch")

    def num_keys(self) -> int:
        raise NotImplementedError("the agent's store does not count its keys")

    def _wait_for(self, key: str, timeout: datetime.timedelta) -> str:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            # The store bounds one wait; a longer one is asked for again.
            left = max(deadline - time.monotonic(), 0.0)
            got = self._conn.get(key, min(left, 60.0))
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(
                    f"timed out after {timeout.total_seconds():.0f} s waiting for {key!r} "
                    f"in the agent's store at {self._conn.address}"
                )
