"""The server's sockets: its port checked before it serves, its connections aborted after.

``check_port`` binds (and closes) the port before the model loads, so a port in use
is one line at once, not a server's traceback later.

``abort_connections`` aborts the TCP connections a server still holds open: the
last step of a bounded shutdown. A client that stops reading its socket keeps the
server's write to it pending for as long as it likes. Hypercorn on trio writes in
a shielded cancel scope, so no cancellation ends that write: the connection, and
so the shutdown, waits forever. The way out that works for any server is below
the server: every open socket of this process that is a connection accepted on
one of the server's ports is reset (``SO_LINGER`` 0, then ``shutdown``). A pending
write then fails at once (the server sees a broken connection, the app an
``http.disconnect``), a pending read sees the end of the stream, and the server
closes the socket itself as usual.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
from collections.abc import Collection, Iterator

from ._errors import CommandError, UsageError

__all__ = ["abort_connections", "address", "check_port"]

_log = logging.getLogger("omni_trio.serve")

#: Where the process's open file descriptors are listed (Linux, then macOS/BSD).
_FD_DIRS = ("/proc/self/fd", "/dev/fd")

#: ``struct linger`` with ``l_onoff`` 1 and ``l_linger`` 0: closing resets the connection
#: (and drops what the kernel still buffers for a client that stopped reading).
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


def _open_fds() -> Iterator[int]:
    for folder in _FD_DIRS:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if name.isdigit():
                yield int(name)
        return
    _log.warning("cannot list open file descriptors: no connection is aborted")


def _accepted_on(fd: int, ports: Collection[int]) -> socket.socket | None:
    """A duplicate of ``fd`` if it is a TCP connection whose local port is in ``ports``."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None  # closed meanwhile, or not a socket Python can wrap
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            local_port = sock.getsockname()[1]
            sock.getpeername()  # raises for a listening (or unconnected) socket
            if local_port in ports:
                return sock
    except OSError:
        pass
    sock.close()
    return None


def abort_connections(ports: Collection[int]) -> int:
    """Reset every TCP connection of this process accepted on one of ``ports``.

    The server keeps its own descriptors and closes them as it normally would;
    only the duplicates made here are closed here. Listening sockets and the
    process's outgoing connections (whose local port is ephemeral) are left alone.

    Args:
        ports: the ports the server listens on.

    Returns:
        How many connections were aborted.
    """
    aborted = 0
    for fd in list(_open_fds()):
        sock = _accepted_on(fd, ports)
        if sock is None:
            continue
        with sock:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue  # the peer reset it first
            aborted += 1
    return aborted


def check_port(host: str, port: int) -> None:
    """Fail now, in one line, if ``host:port`` cannot be bound (in use, or not an address).

    Raises:
        UsageError: ``host`` is not an address (``--host``).
        CommandError: the bind fails; the message says why.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise UsageError(f"--host: cannot listen on {host!r}: {exc.strerror or exc}") from None
    family, kind, proto, _, bound = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As the servers do: a port left in TIME_WAIT by a previous run is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(bound)
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise CommandError(f"cannot listen on {address(host, port)}: {reason}") from None


def address(host: str, port: int) -> str:
    """``host:port`` as a server names it (``[::1]:8000`` for an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
