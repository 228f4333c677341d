"""Picking a free TCP port (for a server that binds later, or a process group's rendezvous),
and the listening socket an HTTP server (the gateway, the Tinker face) serves on."""

from __future__ import annotations

import socket

__all__ = ["free_port", "http_listener"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` a moment ago (another process may take it before use)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_listener(host: str, port: int) -> tuple[socket.socket, str]:
    """A socket listening on ``host:port`` (0: any free port) and the ``host:port`` clients
    dial (IPv6 hosts bracketed).

    It listens before anyone is told the address: a client that connects at once waits in
    the backlog until the server takes it, instead of being refused.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Inherited by the accepted connections: without it a small response waits on Nagle and
    # the client's delayed ACK (measured: 44 ms for the gateway's GET /v1/models).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(128)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return sock, f"{shown}:{bound_port}"
