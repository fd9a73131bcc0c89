"""Nothing omni-pd starts listens beyond the address the user chose (issue 11, criterion 6).

The HTTP server binds the host it is given. Mooncake (0.3.13) binds its two listening sockets, the
P2P handshake port and the TCP data port, to the wildcard address (0.0.0.0 and [::]) whatever host
it is initialised with, and no setting of it changes that; omni_pd.kv.transport (socket_filter.py) attaches a socket
filter to both that drops every connection not addressed to the engine's host (loopback unless
the stage's kv_ip names another address). So these tests read every listening TCP socket of the
server and of every process it started (/proc/<pid>/net/tcp{,6}, socket inodes mapped through
/proc/<pid>/fd), require exactly the documented set (anything new listening fails them), and then
try to connect to each port on loopback and on every other address of this machine.
"""

import ctypes
import ipaddress
import os
import re
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from live_server import MODEL, Server, omni_pd_serve_command

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 1.0
SESSION_LOG = re.compile(
    r"\[stage(\d+)\] omni_pd\.kv\.transport: Mooncake engine (\S+):(\d+) listening "
    r"on ports (\d+), (\d+) \(tcp\), accepting (.+)$",
    re.M,
)


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)  # 32-bit words in host (little-endian) order
    return str(ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(local address, port) of each listening TCP socket that process `pid` holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                    address, port = fields[1].split(":")
                    found.add((_address(address), int(port, 16)))
    return found


def descendants(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def other_addresses() -> list[str]:
    """This machine's addresses other than loopback (and IPv6 link-local, which needs a scope)."""
    addresses = set()
    with open("/proc/net/fib_trie") as handle:
        lines = handle.read().splitlines()
    for previous, line in zip(lines, lines[1:]):
        if line.strip() == "/32 host LOCAL":
            addresses.add(previous.split()[-1])
    if os.path.exists("/proc/net/if_inet6"):
        with open("/proc/net/if_inet6") as handle:
            for line in handle:
                addresses.add(str(ipaddress.ip_address(bytes.fromhex(line.split()[0]))))
    return sorted(
        a
        for a in addresses
        if not ipaddress.ip_address(a).is_loopback and not ipaddress.ip_address(a).is_link_local
    )


def connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        return True
    except OSError:  # refused, or no answer (a filtered SYN is dropped)
        return False


def reachability(pairs: list[tuple[str, int]]) -> dict[tuple[str, int], bool]:
    with ThreadPoolExecutor(max(1, len(pairs))) as pool:
        return dict(zip(pairs, pool.map(lambda pair: connects(*pair), pairs)))


@pytest.fixture(scope="module")
def server():
    srv = Server(lambda port: omni_pd_serve_command(port) + ["--host", HOST])
    yield srv
    srv.stop()


def test_pd_server_listens_only_where_it_was_told(server):
    # One request through prefill -> Mooncake KV fetch -> decode, with the filters in place.
    reply = server.client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        modalities=["text"],
        messages=[{"role": "user", "content": "Where does the KV cache go?"}],
    )
    assert reply.choices[0].message.content is not None

    workers = server.state()["worker_pids"]
    assert len(workers) == 4, workers  # thinker prefill, thinker decode, talker, code2wav
    _, _, talker, code2wav = workers
    sessions = {int(stage): rest for stage, *rest in SESSION_LOG.findall(server.log_text())}
    assert sorted(sessions) == [0, 1], (
        f"expected one Mooncake engine per thinker worker:\n{server.log_text()}"
    )

    expected = {server.proc.pid: {(HOST, server.port)}, talker: set(), code2wav: set()}
    for stage, (host, rpc_port, logged_rpc, data_port, accepted) in sessions.items():
        assert host == HOST and rpc_port == logged_rpc
        # Mooncake's own binding, which no setting of 0.3.13 narrows: handshake on 0.0.0.0,
        # data on [::] (dual stack). The filter makes them answer on loopback only (below).
        expected[workers[stage]] = {("0.0.0.0", int(rpc_port)), ("::", int(data_port))}
    for pid in descendants(server.proc.pid) - set(expected):
        expected[pid] = set()  # any other process it started: nothing
    actual = {pid: listening_sockets(pid) for pid in expected}
    assert actual == expected

    ports = sorted(port for sockets in expected.values() for _, port in sockets)
    elsewhere = other_addresses()
    result = reachability(
        [("127.0.0.1", port) for port in ports] + [(address, port) for address in elsewhere for port in ports]
    )
    assert all(result[("127.0.0.1", port)] for port in ports), result
    assert not any(result[(address, port)] for address in elsewhere for port in ports), {
        pair: ok for pair, ok in result.items() if ok and pair[0] != "127.0.0.1"
    }
    assert [accepted for *_, accepted in sessions.values()] == [
        "connections addressed to 127.0.0.0/8, ::1"
    ] * 2


def test_mooncake_engine_on_a_named_host_answers_only_there():
    """A P/D config's kv_ip (here: this machine's first non-loopback IPv4 address) is the only
    address its Mooncake ports answer on: not loopback, not the machine's other addresses."""
    v4 = [a for a in other_addresses() if ipaddress.ip_address(a).version == 4]
    if not v4:
        pytest.skip("this machine has no non-loopback IPv4 address")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from omni_pd.kv.transport import MooncakeTransport

    host = v4[0]
    owner, reader = MooncakeTransport(host=host), MooncakeTransport(host=host)
    ports = [port for _, port in owner.listeners]
    assert len(ports) == 2 and int(owner.session_id.rsplit(":", 1)[1]) in ports, owner.listeners
    others = ["127.0.0.1", "::1"] + [a for a in other_addresses() if a != host]
    result = reachability([(host, port) for port in ports] + [(a, port) for a in others for port in ports])
    assert all(result[(host, port)] for port in ports), result
    assert not any(result[(a, port)] for a in others for port in ports), result

    # The KV path itself works through the filter: a 64 KiB read between the two engines.
    source = ctypes.create_string_buffer(bytes(range(256)) * 256, 65536)
    target = ctypes.create_string_buffer(65536)
    owner.register(ctypes.addressof(source), 65536)
    reader.register(ctypes.addressof(target), 65536)
    try:
        reader.read(owner.session_id, [(ctypes.addressof(target), ctypes.addressof(source), 65536)])
        assert target.raw == source.raw
    finally:
        owner.unregister(ctypes.addressof(source))
        reader.unregister(ctypes.addressof(target))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
