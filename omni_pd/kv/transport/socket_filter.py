"""Restricting a wildcard-bound listener to one host's addresses, with a classic BPF socket filter.

Mooncake (0.3.13) binds its two listening sockets to the wildcard address whatever
host it is given: the P2P handshake port on 0.0.0.0 and the TCP data port on [::] (dual stack). No
setting changes that (``MC_TCP_BIND_ADDRESS`` only names the address a non-P2P engine advertises).
Anyone who reaches either port can read and write all memory registered with the engine (the KV
pools); the handshake port tells them where it is. So, right after ``initialize()`` and before any
memory is registered, the Mooncake transport (mooncake.py) attaches a socket filter (classic BPF, ``SO_ATTACH_FILTER``) to
both listening sockets that drops every packet not addressed to the engine's host: loopback
(127.0.0.0/8 and ::1) when the host is a loopback address, else exactly the configured kv_ip.
``ss -ltn`` still shows the wildcard address, but a connection to any other address of the machine
gets no answer (its SYN is dropped), as if the socket were bound to the host. The filter is
inherited by accepted connections. ``OMNI_PD_KV_ANY_DESTINATION=1`` skips it (Mooncake's own
behaviour: for NAT set-ups where peers reach this engine at an address other than its kv_ip).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
from typing import cast

from .proc_net import _TCP_ESTABLISHED, own_tcp_sockets

# The package's logger, named as the module was before the split: log lines read as they did
# (operators' filters; e2e/test_network_exposure.py reads the Mooncake engine's line).
log = logging.getLogger(__package__)

ANY_DESTINATION_ENV = "OMNI_PD_KV_ANY_DESTINATION"
_SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; the socket module does not export it
_SKF_NET_OFF = -0x100000  # classic BPF: loads relative to the IP header
_LD_B_ABS, _LD_W_ABS, _AND_K, _JEQ_K, _JA, _RET_K = 0x30, 0x20, 0x54, 0x15, 0x05, 0x06

Destinations = tuple[list[ipaddress.IPv4Network], list[ipaddress.IPv6Address]]


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def allowed_destinations(host: str) -> Destinations | None:
    """The destination addresses a Mooncake engine on `host` accepts; None: every address (the
    host is a wildcard address, or the deployer set OMNI_PD_KV_ANY_DESTINATION)."""
    if os.environ.get(ANY_DESTINATION_ENV, "").lower() in ("1", "true", "yes"):
        return None
    try:
        addresses = {ipaddress.ip_address(host.strip("[]"))}
    except ValueError:  # a host name: what it resolves to here
        addresses = {
            # A TCP (AF_INET / AF_INET6) sockaddr starts with the address as text; typeshed's
            # sockaddr type also covers families whose first item is an int.
            ipaddress.ip_address(cast(str, info[4][0]).split("%")[0])
            for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        }
    v4: list[ipaddress.IPv4Network] = []
    v6: list[ipaddress.IPv6Address] = []
    for address in addresses:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        if address.is_unspecified:
            return None
        if address.is_loopback:
            v4.append(ipaddress.IPv4Network("127.0.0.0/8"))
            v6.append(ipaddress.IPv6Address("::1"))
        elif isinstance(address, ipaddress.IPv4Address):
            v4.append(ipaddress.IPv4Network(address))
        else:
            v6.append(address)
    return sorted(set(v4)), sorted(set(v6))


def destination_filter(allowed: Destinations) -> list[tuple[int, int, int, int]]:
    """A classic BPF program (code, jt, jf, k) that keeps IPv4/IPv6 packets whose destination is
    in `allowed` and drops the rest."""
    v4, v6 = allowed
    program: list[list] = []  # [code, jt label, jf label, k]; labels resolve to relative jumps
    labels: dict[str, int] = {}

    def emit(code: int, k: int = 0, jt: str | None = None, jf: str | None = None) -> None:
        program.append([code, jt, jf, k & 0xFFFFFFFF])

    emit(_LD_B_ABS, _SKF_NET_OFF)  # A = first byte of the IP header
    emit(_AND_K, 0xF0)  # A = version << 4
    emit(_JEQ_K, 0x40, jt="v4", jf="not_v4")
    labels["not_v4"] = len(program)
    emit(_JEQ_K, 0x60, jt="v6", jf="drop")
    labels["v4"] = len(program)
    for network in v4:
        emit(_LD_W_ABS, _SKF_NET_OFF + 16)  # IPv4 destination address
        emit(_AND_K, int(network.netmask))
        emit(_JEQ_K, int(network.network_address), jt="accept")
    emit(_JA, jt="drop")
    labels["v6"] = len(program)
    for index, address in enumerate(v6):
        words = [int.from_bytes(address.packed[i : i + 4], "big") for i in range(0, 16, 4)]
        for w, word in enumerate(words):
            emit(_LD_W_ABS, _SKF_NET_OFF + 24 + 4 * w)  # IPv6 destination address, word w
            emit(_JEQ_K, word, jt="accept" if w == 3 else None, jf=f"v6_next{index}")
        labels[f"v6_next{index}"] = len(program)
    labels["drop"] = len(program)
    emit(_RET_K, 0)
    labels["accept"] = len(program)
    emit(_RET_K, 0xFFFFFFFF)
    resolved = []
    for pc, (code, jt, jf, k) in enumerate(program):

        def rel(label):
            return 0 if label is None else labels[label] - pc - 1

        if code == _JA:
            resolved.append((code, 0, 0, rel(jt)))
        else:
            resolved.append((code, rel(jt), rel(jf), k))
    return resolved


def _attach_filter(fd: int, program: list[tuple[int, int, int, int]]) -> None:
    instructions = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    fprog = _SockFprog(len(program), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    if (
        libc.setsockopt(fd, socket.SOL_SOCKET, _SO_ATTACH_FILTER, ctypes.byref(fprog), ctypes.sizeof(fprog))
        != 0
    ):
        errno = ctypes.get_errno()
        raise OSError(errno, f"setsockopt(SO_ATTACH_FILTER) on fd {fd}: {os.strerror(errno)}")


def _is_allowed(address, allowed: Destinations) -> bool:
    v4, v6 = allowed
    if isinstance(address, ipaddress.IPv4Address):
        return any(address in network for network in v4)
    return address in v6


def restrict_listeners(new_listeners: list[tuple[int, int]], allowed: Destinations) -> None:
    """Attach the destination filter to each (fd, port), then shut down any connection accepted
    on those ports before the filter was there and addressed elsewhere."""
    program = destination_filter(allowed)
    for fd, _ in new_listeners:
        _attach_filter(fd, program)
    ports = {port for _, port in new_listeners}
    libc = ctypes.CDLL(None, use_errno=True)
    for fd, state, address, port in own_tcp_sockets():
        if state == _TCP_ESTABLISHED and port in ports and not _is_allowed(address, allowed):
            log.warning("closing a Mooncake connection to %s:%d accepted before the filter", address, port)
            libc.shutdown(fd, socket.SHUT_RDWR)
