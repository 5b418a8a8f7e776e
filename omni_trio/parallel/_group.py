"""The torch.distributed group of the ranks: loopback only, an explicit timeout, one per process.

- **Rendezvous.** Rank 0 binds a socket to 127.0.0.1 itself and hands it to the
  ``TCPStore`` it serves (``master_listen_fd``): given only an address, the store
  listens on every interface. The store owns the socket from then on and closes it
  when the group is destroyed.
- **Transport.** gloo and NCCL pick the interface of the machine's host name for
  their own connections, which may be an external one; every rank's are put on the
  loopback interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) while groups
  are made, so nothing the group opens listens beyond loopback.
- **Timeout.** Every collective has the group's timeout (``timeout_s``), not
  torch's 30 minutes; a collective that times out raises, and the runner treats
  that as the group's death. On NCCL the watchdog is told to abort the
  communicator and raise, not to end the process (which would be the engine's).
- **One group per process.** diffusers' context parallelism needs torch's default
  group, and a process has one; a second ``ParallelRunner`` in one process is
  refused while the first is open.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "all_gather",
    "close_group",
    "group_in_use",
    "listening_socket",
    "loopback_interfaces",
    "open_group",
]

#: The loopback interface's name on Linux.
_LOOPBACK = "lo"
#: What every group is made with; the NCCL setting keeps a timeout from ending the process.
_ENVIRONMENT = {
    "GLOO_SOCKET_IFNAME": _LOOPBACK,
    "NCCL_SOCKET_IFNAME": _LOOPBACK,
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}


def listening_socket() -> socket.socket:
    """A socket bound to 127.0.0.1 on a free port, listening: the rendezvous's."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


@contextmanager
def loopback_interfaces() -> Iterator[None]:
    """Make groups inside the block on the loopback interface (the environment is restored)."""
    saved = {name: os.environ.get(name) for name in _ENVIRONMENT}
    os.environ.update(_ENVIRONMENT)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def group_in_use() -> bool:
    """Whether this process has torch's default group already."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def open_group(
    *,
    rank: int,
    world: int,
    port: int,
    listen: socket.socket | None,
    backend: str,
    timeout_s: float,
) -> None:
    """Join (rank 0: serve) the rendezvous on 127.0.0.1:``port`` and make the default group.

    Args:
        rank: this process's rank.
        world: how many ranks.
        port: the rendezvous's port.
        listen: rank 0's listening socket (from ``listening_socket``), handed to
            the store, which closes it; ``None`` on the other ranks.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: every collective's timeout, and the rendezvous's.
    """
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    timeout = datetime.timedelta(seconds=timeout_s)
    if listen is not None:
        store = TCPStore(
            "127.0.0.1",
            port,
            world,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listen.detach(),
        )
    else:
        store = TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    with loopback_interfaces():
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def close_group() -> None:
    """Destroy this process's default group, if it has one (its store and sockets with it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """Gather every rank's ``tensor`` into ``output`` (rank order, along the first dimension)."""
    import torch.distributed as dist

    dist.all_gather_single(output, tensor)
