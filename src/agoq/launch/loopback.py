"""Keep a local run's network endpoints on the loopback interface.

torch's TCPStore binds its listening socket to every interface, unless it is handed a socket that
already listens (its ``master_listen_fd`` option). A local run therefore creates both of its stores
on sockets bound to 127.0.0.1: the launcher's rendezvous store, and rank 0's process-group store.
gloo's own connections follow ``GLOO_SOCKET_IFNAME``, set to the loopback interface
(agoq.launch.forkserver.local_worker_env). Multi-node runs (torchrun) are left as torch sets them
up: their stores must be reachable from other hosts.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now (for a server started just after; another process may take it first)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(port: int = 0) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 (``port`` 0: any free one)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, port))
    sock.listen(128)
    return sock


def loopback_store(port: int = 0, timeout: timedelta = timedelta(seconds=300)) -> tuple[dist.TCPStore, int]:
    """A TCPStore server that listens on 127.0.0.1 only, and its port (keep the store alive while it is used)."""
    sock = listening_socket(port)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        HOST,
        port,
        is_master=True,
        master_listen_fd=sock.fileno(),
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timeout,
    )
    sock.detach()  # the store owns the descriptor now and closes it when it goes
    return store, port


_kept: list[object] = []  # rank 0's store lives as long as the process


def process_group_store(timeout: timedelta = timedelta(minutes=30)) -> dist.TCPStore:
    """The store of a local run's process group at MASTER_ADDR:MASTER_PORT: hosted by rank 0 on loopback, the others connect."""
    port = int(os.environ["MASTER_PORT"])
    if int(os.environ["RANK"]) == 0:
        store, _ = loopback_store(port, timeout)
        _kept.append(store)
        return store
    return dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
