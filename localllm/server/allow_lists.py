"""Which ``Host`` names and which web page origins the server answers: the allow-lists of
``localllm serve`` (``--allowed-hosts``, ``--allowed-origins`` and their environment
variables) and the tests on one header value. Torch-free: ``serve`` reads the flags before
it binds and loads the model, so a bad entry fails in a second.

Invariants: every name in ``allowed_hosts`` is lowercased, without a port, brackets or a
trailing dot, and every entry of ``allowed_origins`` is in the form ``origin_key`` gives, the
form a browser's ``Origin`` header takes; so both tests are set look-ups.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from localllm.errors import LocalLLMError

HOSTS_ENV = "LOCALLLM_ALLOWED_HOSTS"
ORIGINS_ENV = "LOCALLLM_ALLOWED_ORIGINS"
ANY = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_PORT = re.compile(r"\d{1,5}")
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def split_host(header: str) -> tuple[str, str | None]:
    """``Host`` (``name``, ``name:port``, ``[v6]`` or ``[v6]:port``) -> (name, port), the name
    normalized as ``allowed_hosts`` holds names. A malformed port gives port None and a name
    that nothing allows."""
    value = header.strip().lower()
    if value.startswith("["):
        name, close, rest = value[1:].partition("]")
        if not close or (rest and not (rest.startswith(":") and _PORT.fullmatch(rest[1:]))):
            return value, "?"
        return name, rest[1:] or None
    name, colon, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    if colon and not _PORT.fullmatch(port):
        return value, "?"
    return name.rstrip("."), port or None


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """``localhost`` (and its subdomains, which browsers also keep on this machine), 127.0.0.0/8
    and ::1 (also as an IPv4-mapped address)."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    ip = _ip(name)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip is not None and ip.is_loopback


def origin_key(origin: str) -> str | None:
    """An origin as a browser serializes it (``scheme://host[:port]``, lowercase, no default
    port), or None when ``origin`` is not one. ``null`` (sandboxed frames, file pages) stays
    ``null``: only an allow-list that names it admits it."""
    value = origin.strip()
    if value == "null":
        return value
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment \
            or parts.username is not None or parts.password is not None:
        return None
    scheme, host = parts.scheme.lower(), parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}" if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{scheme}://{host}:{port}"


@dataclass(frozen=True, slots=True)
class AllowLists:
    """Besides loopback names, the ``Host`` names the server answers (``*``: any), whether any
    IP address is one (bound to every interface: each of the machine's addresses is its name),
    and the origins whose pages may call it (none by default; ``*``: any)."""

    allowed_hosts: frozenset[str] = frozenset()
    any_ip_host: bool = False
    allowed_origins: frozenset[str] = frozenset()

    def host_allowed(self, header: str | None) -> bool:
        # No Host at all is HTTP/1.0 from a program: browsers always send one.
        if header is None or ANY in self.allowed_hosts:
            return True
        name, port = split_host(header)
        if port == "?":
            return False
        # An IP literal cannot be rebound to another machine by DNS; a name can.
        return is_loopback(name) or name in self.allowed_hosts or (self.any_ip_host and _ip(name) is not None)

    def origin_allowed(self, header: str) -> bool:
        return ANY in self.allowed_origins or origin_key(header) in self.allowed_origins


def _entries(flag: str | None, flag_name: str, env_name: str) -> tuple[list[str], str]:
    source, text = flag_name, flag
    if text is None:
        source, text = env_name, os.environ.get(env_name, "")
    return [e.strip() for e in text.split(",") if e.strip()], source


def allow_lists(bind_host: str, hosts: str | None = None, origins: str | None = None) -> AllowLists:
    """The lists for a server bound to ``bind_host``, from the comma-separated flag values
    (None: the environment variable's). A non-loopback address given to ``--host`` is a name of
    the server; 0.0.0.0 and :: make every IP address one."""
    names: set[str] = set()
    host_entries, source = _entries(hosts, "--allowed-hosts", HOSTS_ENV)
    for entry in host_entries:
        name, port = split_host(entry)
        if port == "?" or not name or "/" in name or (":" in name and _ip(name) is None):
            raise LocalLLMError(f"{source}: '{entry}' is not a host name or address; give names such as "
                                "myhost.lan or 192.168.1.20, separated by commas ('*' for any)")
        names.add(name)
    bound, _ = split_host(bind_host)
    if bound not in _WILDCARD_BINDS and not is_loopback(bound):
        names.add(bound)
    keys: set[str] = set()
    origin_entries, source = _entries(origins, "--allowed-origins", ORIGINS_ENV)
    for entry in origin_entries:
        key = ANY if entry == ANY else origin_key(entry)
        if key is None:
            raise LocalLLMError(f"{source}: '{entry}' is not an origin; give scheme://host[:port] without a path, "
                                "e.g. http://localhost:3000, separated by commas ('*' for any)")
        keys.add(key)
    return AllowLists(frozenset(names), bound in _WILDCARD_BINDS, frozenset(keys))
