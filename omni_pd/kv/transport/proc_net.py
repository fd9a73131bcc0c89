"""What this process's TCP sockets are, read from /proc (`/proc/<pid>/fd` and `/proc/<pid>/net/tcp*`):
the Mooncake transport finds the listening sockets its engine opened, and the socket filter the
connections they accepted before it was attached. Linux only."""

from __future__ import annotations

import ipaddress
import os

_TCP_LISTEN, _TCP_ESTABLISHED = "0A", "01"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _proc_address(hex_address: str) -> IPAddress:
    raw = bytes.fromhex(hex_address)  # 32-bit words in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def listening_sockets() -> dict[str, tuple[int, int]]:
    """This process's listening TCP sockets: inode -> (fd, port)."""
    return {inode: (fd, port) for fd, state, _, port, inode in _tcp_sockets("self") if state == _TCP_LISTEN}


def own_tcp_sockets(pid: int | str = "self") -> list[tuple[int, str, IPAddress, int]]:
    """(fd, state, local address, local port) of each TCP socket open in process `pid`."""
    return [entry[:4] for entry in _tcp_sockets(pid)]


def _tcp_sockets(pid: int | str) -> list[tuple[int, str, IPAddress, int, str]]:
    """(fd, state, local address, local port, inode) of each TCP socket open in `pid`."""
    inode_fd: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inode_fd[target[8:-1]] = int(fd)
    sockets = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as handle:
                lines = handle.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inode_fd:
                address, port = fields[1].split(":")
                sockets.append(
                    (inode_fd[fields[9]], fields[3], _proc_address(address), int(port, 16), fields[9])
                )
    return sockets
