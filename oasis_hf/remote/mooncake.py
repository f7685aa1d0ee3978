"""Mooncake Store as the remote KV tier: the services (for tests and local demos) and the client OasisKV uses.

Mooncake Store (the KV store vLLM and SGLang use for prefill/decode disaggregation) keeps objects in memory
segments that client processes contribute; a master process holds only the metadata. `MooncakeCluster` starts a
master and one pool process (the segment owner) on loopback, on free ports, and stops both. `MooncakeTier` is one
process's client: batched zero-copy puts and gets of fixed-size blocks, with every Mooncake return code turned into
an exception that names the key and the fix (Mooncake itself never raises: a missing key is ``-704``, a dead master
``-900`` after about 4 s of retries, a dead pool ``-800``).

Needs ``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`` (CPU) or ``mooncake-transfer-engine-cuda13``
(GPU), and the system library ``libibverbs1`` (``apt-get install libibverbs1``), loaded even without RDMA.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from oasis_hf.errors import RemoteTierError

logger = logging.getLogger(__name__)

#: Mooncake's error codes (mooncake-store/include/types.h) that we name in messages.
ERROR_NAMES = {
    -200: "NO_AVAILABLE_HANDLE (the pool is full)",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL (the pool process holding the data is unreachable)",
    -900: "RPC_FAIL (the master is unreachable)",
    -901: "RPC_TIMEOUT (the master did not answer)",
}

#: Environment every Mooncake process of ours gets: advertise loopback, not the first network interface, and keep
#: the glog output short.
LOOPBACK_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}


def _import_store():
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise RemoteTierError(
            f"Mooncake Store is not importable ({exc}). Install it with `pip install "
            "mooncake-transfer-engine-non-cuda==0.3.13.post1` (CPU) or `mooncake-transfer-engine-cuda13` (GPU); "
            "its native library also needs `apt-get install libibverbs1`"
        ) from exc
    return MooncakeDistributedStore, ReplicateConfig


SERVICES = ("mooncake_master", "mooncake_client")


def service_binary(name: str) -> str | None:
    """The path of Mooncake's service executable `name`: on PATH, or else next to the running interpreter (where pip
    puts a virtual environment's executables, which are not on PATH unless the environment is activated)."""
    found = shutil.which(name)
    if found is None:
        beside = Path(sys.executable).parent / name
        found = str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None
    return found


def mooncake_missing() -> str | None:
    """What keeps the Mooncake tier from running here (the client library or a service executable), or None."""
    try:
        _import_store()
    except RemoteTierError as exc:
        return str(exc)
    absent = [name for name in SERVICES if service_binary(name) is None]
    if absent:
        return (f"Mooncake's service executables {absent} are neither on PATH nor next to {sys.executable}; "
                "install mooncake-transfer-engine-non-cuda==0.3.13.post1 (CPU) or mooncake-transfer-engine-cuda13 "
                "(GPU) into this environment")
    return None


def mooncake_available() -> bool:
    """Whether the Mooncake client imports and its service executables are found (`mooncake_missing` says why
    not)."""
    return mooncake_missing() is None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, process: subprocess.Popen, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RemoteTierError(f"{what} exited with code {process.returncode} while starting")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.1):
            return
        time.sleep(0.05)
    raise RemoteTierError(f"{what} did not accept connections on 127.0.0.1:{port} within {timeout_s:.0f} s")


class MooncakeCluster:
    """A Mooncake master and one pool process on loopback (random free ports), for tests and local demos.

    Parameters
    ----------
    pool_bytes : memory the pool process contributes (its segment), e.g. ``1 << 30``.
    start_timeout_s : how long each service may take to accept connections.

    Use as a context manager (``with MooncakeCluster(1 << 30) as cluster: ...``) or call `start` / `stop`;
    `stop` is idempotent and leaves no process behind. ``cluster.master_address`` is what clients connect to.
    """

    def __init__(self, pool_bytes: int = 1 << 30, start_timeout_s: float = 15.0) -> None:
        if pool_bytes <= 0:
            raise ValueError(f"MooncakeCluster: pool_bytes must be positive, got {pool_bytes}")
        self.pool_bytes = pool_bytes
        self.start_timeout_s = start_timeout_s
        self.master: subprocess.Popen | None = None
        self.pool: subprocess.Popen | None = None
        self.rpc_port = self.metrics_port = self.pool_port = 0
        # The services run in their own sessions (a Ctrl-C of the caller does not reach them), so stop them when
        # the cluster object is collected or the interpreter exits, if `stop` was never called.
        self._processes: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._processes)

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self) -> MooncakeCluster:
        master, client = (service_binary(name) for name in SERVICES)
        if master is None or client is None:
            raise RemoteTierError(mooncake_missing() or "Mooncake's service executables are missing")
        env = dict(os.environ, **LOOPBACK_ENV)
        self.rpc_port, self.metrics_port, self.pool_port = _free_port(), _free_port(), _free_port()
        try:
            self.master = subprocess.Popen(
                [master, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
                 "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}", "--rpc_thread_num=2",
                 "--logtostderr=true", "--minloglevel=2"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent(),
            )  # fmt: skip
            self._processes.append(self.master)
            _wait_port(self.rpc_port, self.master, "mooncake_master", self.start_timeout_s)
            self.pool = subprocess.Popen(
                [client, "--host=127.0.0.1", f"--port={self.pool_port}",
                 f"--global_segment_size={self.pool_bytes}", f"--master_server_address={self.master_address}",
                 "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent(),
            )  # fmt: skip
            self._processes.append(self.pool)
            _wait_port(self.pool_port, self.pool, "mooncake_client (pool)", self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("Mooncake master at %s, pool of %.1f MiB", self.master_address, self.pool_bytes / 2**20)
        return self

    def kill_master(self) -> None:
        """SIGKILL the master (fault injection in tests)."""
        _kill(self.master, signal.SIGKILL)

    def kill_pool(self) -> None:
        """SIGKILL the pool process (fault injection in tests)."""
        _kill(self.pool, signal.SIGKILL)

    def stop(self) -> None:
        """Stop the pool, then the master (SIGTERM, SIGKILL after 5 s); idempotent."""
        _stop_all(self._processes)
        self.pool = self.master = None

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent():
    """A ``preexec_fn`` that makes the child receive SIGKILL when the process that starts it dies, however it dies
    (SIGTERM and SIGKILL run no finalizer; the services run in their own sessions, so no Ctrl-C reaches them):
    Linux's ``PR_SET_PDEATHSIG``. The signal follows the *thread* that started the child, so start a cluster from a
    thread that lives as long as it (the main thread, usually). Elsewhere (no prctl) only `stop`, the finalizer and
    interpreter exit stop the services."""
    parent = os.getpid()
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above: do not outlive it
            os._exit(1)

    return preexec


def _stop_all(processes: list[subprocess.Popen]) -> None:
    """SIGTERM (then SIGKILL) the pool before the master; empties the list."""
    for process in reversed(processes):
        _kill(process, signal.SIGTERM)
    processes.clear()


def _kill(process: subprocess.Popen | None, sig: int) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


class MooncakeTier:
    """One process's client of a Mooncake Store: batched puts and gets of byte ranges, errors as exceptions.

    Parameters
    ----------
    master_address : ``host:port`` of the master (`MooncakeCluster.master_address`).
    local_buffer_bytes : the client's staging buffer for non-zero-copy transfers (covers the largest batch).
    segment_bytes : memory this process contributes to the pool (0: it only reads and writes, the usual case).
    hard_pin : pin every object this client writes, so a full pool fails the write (``-200``) instead of
        silently evicting a live request's blocks.

    Every call that Mooncake answers with a negative code raises `RemoteTierError` naming the key(s), the code
    and what to do. A dead master makes Mooncake retry for about 4 s before answering, so errors surface within
    seconds, never as a hang.
    """

    def __init__(self, master_address: str, local_buffer_bytes: int = 64 << 20, segment_bytes: int = 0,
                 hard_pin: bool = True) -> None:  # fmt: skip
        store_cls, replicate_cls = _import_store()
        for key, value in LOOPBACK_ENV.items():  # read by the transfer engine at setup
            os.environ.setdefault(key, value)
        self.master_address = master_address
        self._store = store_cls()
        rc = self._store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "",
                               master_address)
        if rc != 0:
            raise RemoteTierError(
                f"could not connect to the Mooncake master at {master_address} (setup returned {rc}); check that "
                "mooncake_master runs there and MC_TCP_BIND_ADDRESS matches the address peers can reach"
            )
        self._config = replicate_cls()
        self._config.with_hard_pin = hard_pin
        self._closed = False

    # ------------------------------------------------------------------------------------------------ blocks
    def put(self, keys: Sequence[str], pointers: Sequence[int], sizes: Sequence[int], overwrite: bool = False) -> None:
        """Write ``sizes[i]`` bytes at address ``pointers[i]`` under ``keys[i]`` (one batched call).

        Mooncake's put keeps an existing value; ``overwrite=True`` replaces it (upsert)."""
        if not keys:
            return
        if overwrite:
            codes = self._store.batch_upsert_from(list(keys), list(pointers), list(sizes), self._config)
        else:
            codes = self._store.batch_put_from(list(keys), list(pointers), list(sizes), self._config)
        self._check(codes, keys, "write")

    def get(self, keys: Sequence[str], pointers: Sequence[int], sizes: Sequence[int]) -> None:
        """Read ``keys[i]`` into ``sizes[i]`` bytes at ``pointers[i]`` (one batched call); a missing key raises."""
        if not keys:
            return
        codes = self._store.batch_get_into(list(keys), list(pointers), list(sizes))
        self._check(codes, keys, "read", sizes)

    def put_bytes(self, key: str, value: bytes) -> None:
        code = self._store.upsert(key, value)
        self._check([code], [key], "write")

    def get_bytes(self, key: str) -> bytes:
        size = self._store.get_size(key)
        if size < 0:
            self._check([size], [key], "read")
        value = self._store.get(key)
        if len(value) != size:
            raise RemoteTierError(f"Mooncake returned {len(value)} of {size} bytes for {key!r}")
        return value

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._store.batch_is_exist(list(keys))
        self._check([c for c in codes if c < 0], [k for k, c in zip(keys, codes, strict=True) if c < 0], "query")
        return [c == 1 for c in codes]

    def remove(self, keys: Sequence[str]) -> None:
        """Remove `keys` (forced past read leases); keys already gone are fine."""
        if not keys:
            return
        codes = self._store.batch_remove(list(keys), True)
        self._check([c for c in codes if c not in (0, -704)], [k for k, c in zip(keys, codes, strict=True)
                                                               if c not in (0, -704)], "remove")

    def register(self, pointer: int, size: int) -> None:
        """Register a host buffer that puts and gets will use (RDMA reads and writes it directly; over TCP it is
        optional)."""
        code = self._store.register_buffer(pointer, size)
        if code != 0:
            raise RemoteTierError(f"Mooncake could not register a {size}-byte buffer (code {code}); on RDMA the "
                                  "memory must be lockable (ulimit -l)")

    def unregister(self, pointer: int) -> None:
        self._store.unregister_buffer(pointer)

    def close(self) -> None:
        """Disconnect (idempotent)."""
        if not self._closed:
            self._closed = True
            self._store.close()

    # ------------------------------------------------------------------------------------------------ errors
    def _check(self, codes, keys, what: str, sizes=None) -> None:
        bad = [(key, code) for key, code in zip(keys, codes, strict=True) if code < 0]
        if sizes is not None:
            short = [(k, c) for k, c, s in zip(keys, codes, sizes, strict=True) if 0 <= c != s]
            if short:
                raise RemoteTierError(f"Mooncake returned {short[0][1]} bytes for {short[0][0]!r}, expected a "
                                      f"whole block; the tier holds another layout (a different model or config?)")
        if not bad:
            return
        key, code = bad[0]
        name = ERROR_NAMES.get(code, "unknown error")
        hint = {
            -704: "the block was never written or was evicted: publish the request again, or give the pool more "
                  "memory (writes are hard-pinned, so a live request is only lost if its keys were removed)",
            -200: "the Mooncake pool is full: give the pool process more memory (global_segment_size) or finish "
                  "requests to free theirs",
            -800: "the pool process that holds the data is gone; restart it and publish the request again",
            -900: f"the master at {self.master_address} is unreachable; a restarted master has lost every key, "
                  "so publish the request again",
            -901: f"the master at {self.master_address} timed out",
        }.get(code, "see mooncake-store/include/types.h")
        raise RemoteTierError(
            f"Mooncake {what} of {len(bad)} of {len(keys)} keys failed, first {key!r}: {code} {name}; {hint}"
        )
