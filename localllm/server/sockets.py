"""The listening socket, bound before torch and the model load (so a busy port fails in a
second), and the URL it answers at. Torch-free: ``localllm serve`` binds from here first."""

from __future__ import annotations

import socket

from localllm.errors import LocalLLMError


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket; a bad or busy address is a one-line error."""
    if not 0 <= port <= 65535:
        raise LocalLLMError(f"--port {port}: must be in 0..65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise LocalLLMError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (IPv6 hosts in brackets), without /v1."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
