"""The non-blocking read path without a network: AsyncRead / the submitter thread against a fake
Mooncake engine, and KVReceiver's miss window and quarantine on a fake clock."""

import math
import threading
import time

import pytest

from omni_pd.kv import (
    BlockLayout,
    IllegalTransition,
    KVDescriptor,
    KVMissError,
    KVReceiver,
    KVTransferError,
    ReadState,
    TransferState,
)
from omni_pd.kv.handoff import Transfer
from omni_pd.kv.transport.mooncake import AsyncRead, _Submitter

LAYOUT = BlockLayout.default_for(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)


class FakeEngine:
    """batch_transfer_async_read / transfer_check_status with scripted outcomes. A session in
    `hang` blocks the submit until released (Mooncake's first-contact handshake)."""

    def __init__(self):
        self.status: dict[int, int] = {}  # batch id -> what transfer_check_status answers
        self.final: set[int] = set()  # ids that already reported a final status
        self.hang: dict[str, threading.Event] = {}
        self.submitted: list[tuple[str, int]] = []
        self.next_id = 1000

    def batch_transfer_async_read(self, session, local, remote, lengths):
        if session in self.hang:
            self.hang[session].wait(10)
        if session == "dead":
            return 0
        self.next_id += 1
        self.status[self.next_id] = 0
        self.submitted.append((session, self.next_id))
        return self.next_id

    def transfer_check_status(self, batch_id):
        assert batch_id not in self.final, "polled a batch after its final status (use after free)"
        rc = self.status[batch_id]
        if rc in (1, -1):
            self.final.add(batch_id)
        return rc


def _read(engine, session="peer", segments=2):
    read = AsyncRead(session, segments, 100 * segments, engine)
    return read, [(i * 100, i * 100, 100) for i in range(segments)]


def _settle(read, limit_s=5.0):
    began = time.monotonic()
    while read._stage not in ("submitted", "withdrawn"):
        assert time.monotonic() - began < limit_s
        time.sleep(0.001)


def test_async_read_is_done_only_when_every_batch_is():
    engine = FakeEngine()
    submitter = _Submitter(engine, "test")
    read, entries = _read(engine)
    submitter.put(read, entries)
    _settle(read)
    (_, a), (_, b) = engine.submitted  # one batch per segment
    assert read.poll() is ReadState.IN_FLIGHT and not read.settled
    engine.status[a] = 1
    assert read.poll() is ReadState.IN_FLIGHT
    engine.status[b] = 1
    assert read.poll() is ReadState.DONE and read.settled and not read.failed
    assert read.poll() is ReadState.DONE  # finished batches are never polled again


def test_a_failed_batch_fails_the_read_but_it_settles_only_when_all_end():
    engine = FakeEngine()
    submitter = _Submitter(engine, "test")
    read, entries = _read(engine)
    submitter.put(read, entries)
    _settle(read)
    (_, a), (_, b) = engine.submitted
    engine.status[a] = -1
    assert read.poll() is ReadState.FAILED and read.failed and not read.settled  # b may still write
    engine.status[b] = 1
    assert read.poll() is ReadState.FAILED and read.settled


def test_refused_submit_is_a_settled_failure():
    engine = FakeEngine()
    submitter = _Submitter(engine, "test")
    read, entries = _read(engine, session="dead")
    submitter.put(read, entries)
    _settle(read)
    assert read.poll() is ReadState.FAILED and read.settled and "refused" in read.error


def test_reads_queued_behind_a_stuck_handshake_can_be_withdrawn():
    engine = FakeEngine()
    engine.hang["frozen"] = threading.Event()
    submitter = _Submitter(engine, "test")
    stuck, entries = _read(engine, session="frozen", segments=1)
    queued, queued_entries = _read(engine, session="other", segments=1)
    submitter.put(stuck, entries)
    submitter.put(queued, queued_entries)
    while stuck._stage != "submitting":
        time.sleep(0.001)
    assert stuck.poll() is ReadState.IN_FLIGHT
    assert queued.withdraw() and queued.settled and queued.poll() is ReadState.FAILED
    assert not stuck.withdraw() and not stuck.settled  # Mooncake has it: it may still write
    engine.hang["frozen"].set()
    last, last_entries = _read(engine, session="last", segments=1)
    submitter.put(last, last_entries)  # in order: once it is out, the queue is drained
    _settle(last)
    assert [s for s, _ in engine.submitted] == ["frozen", "last"]  # the withdrawn read never went out
    engine.status[engine.submitted[0][1]] = 1
    assert stuck.poll() is ReadState.DONE and stuck.settled


# -- KVReceiver's wait and quarantine -------------------------------------------------------------


class FakeTransport:
    """MooncakeTransport's read interface over FakeEngine (no bytes move)."""

    def __init__(self):
        self.engine = FakeEngine()
        self.submitter = _Submitter(self.engine, "test")
        self.registered = {}
        self.reads: list[tuple[AsyncRead, list]] = []
        self.protocol = "tcp"

    def register(self, address, nbytes):
        self.registered[address] = nbytes

    def unregister(self, address):
        del self.registered[address]

    def submit_read(self, session, segments):
        read = AsyncRead(session, len(segments), sum(s[2] for s in segments), self.engine)
        self.reads.append((read, segments))
        self.submitter.put(read, segments)
        return read

    def read_failure(self, read):
        return KVTransferError(f"KV read from peer {read.remote_session} failed ({read.error})")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _descriptor(num_tokens=6):
    return KVDescriptor(
        transfer_id="t1",
        remote_engine_id="prefill-x",
        remote_session="10.0.0.9:1234",
        remote_block_ids=tuple(range(LAYOUT.num_blocks_for(num_tokens))),
        remote_base_address=1 << 20,
        block_bytes=LAYOUT.block_bytes,
        num_tokens=num_tokens,
        kv_layout=LAYOUT,
        block_checksums=("0",) * LAYOUT.num_blocks_for(num_tokens),
    )


@pytest.fixture
def setup():
    transport, clock = FakeTransport(), Clock()
    return KVReceiver(LAYOUT, 8, transport, clock=clock), transport, clock


def test_receiver_miss_window_and_quarantine(setup):
    receiver, transport, clock = setup
    receiver.start(_descriptor(), wait_s=5.0, into=receiver.pool.allocate(2))
    _settle(transport.reads[0][0])
    assert receiver.poll("t1") is None
    clock.now += 4.9
    assert receiver.poll("t1") is None
    clock.now += 0.2
    with pytest.raises(KVMissError) as info:
        receiver.poll("t1")
    message = str(info.value)
    assert "t1" in message and "10.0.0.9:1234" in message and "prefill-x" in message
    assert "5 s" in message and "kv_miss_window_s" in message and "check that the prefill worker" in message
    assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 2}
    assert receiver.reclaim() == 0  # Mooncake has not ended the read
    transport.engine.status[transport.engine.submitted[0][1]] = 1  # a late answer lands
    assert receiver.reclaim() == 2
    assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}


def test_receiver_failed_read_frees_at_once_and_says_what_to_check(setup):
    receiver, transport, _ = setup
    receiver.start(_descriptor(), wait_s=math.inf, into=receiver.pool.allocate(2))
    _settle(transport.reads[0][0])
    transport.engine.status[transport.engine.submitted[0][1]] = -1
    with pytest.raises(KVTransferError, match="10.0.0.9:1234 failed"):
        receiver.poll("t1")
    assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}


def test_receiver_abandon_withdraws_or_quarantines(setup):
    receiver, transport, _ = setup
    transport.engine.hang["10.0.0.9:1234"] = threading.Event()
    receiver.start(_descriptor(), wait_s=math.inf, into=receiver.pool.allocate(2))
    while transport.reads[0][0]._stage != "submitting":
        time.sleep(0.001)
    second = KVDescriptor(**{**_descriptor().__dict__, "transfer_id": "t2"})
    receiver.start(second, wait_s=math.inf, into=receiver.pool.allocate(2))
    receiver.abandon("t2", "aborted")  # still queued: withdrawn, freed at once
    receiver.abandon("t1", "aborted")  # in Mooncake's hands: quarantined
    receiver.abandon("unknown", "aborted")
    assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 2}
    transport.engine.hang["10.0.0.9:1234"].set()
    _settle(transport.reads[0][0])
    transport.engine.status[transport.engine.submitted[0][1]] = 1
    assert receiver.reclaim() == 2
    assert [s for s, _ in transport.engine.submitted] == ["10.0.0.9:1234"]


def test_abandoned_state_is_final():
    transfer = Transfer("t", [0], TransferState.TRANSFERRING)
    transfer.move(TransferState.ABANDONED, "window")
    with pytest.raises(IllegalTransition):
        transfer.move(TransferState.DONE)


# -- integrity checked while the read flies --------------------------------------------------------


@pytest.mark.parametrize("bad_block", [0, 1])
def test_blocks_are_verified_as_their_entries_land(setup, monkeypatch, bad_block):
    """With one entry per block, block 0 is checked at the poll that sees its entry land, while
    block 1's entry still flies; a corrupted block fails the transfer as soon as it is checked
    (its blocks quarantined if Mooncake still writes them)."""
    import dataclasses

    import torch

    from omni_pd.kv.checksum import checksum
    from omni_pd.kv.errors import KVIntegrityError
    from omni_pd.kv.handoff import receiver as handoff_receiver

    receiver, transport, _clock = setup
    monkeypatch.setattr(handoff_receiver, "MAX_ENTRY_BYTES", LAYOUT.block_bytes)
    into = receiver.pool.allocate(2)
    for block in into:
        receiver.pool.block_view(block).zero_()  # what a fake read "lands": zeros
    lengths = LAYOUT.transfer_lengths(6)
    sums = [checksum(torch.zeros(n, dtype=torch.uint8)) for n in lengths]
    sums[bad_block] = "corrupt"
    receiver.start(
        dataclasses.replace(_descriptor(), block_checksums=tuple(sums)), wait_s=math.inf, into=into
    )
    read = transport.reads[0][0]
    _settle(read)
    assert len(transport.reads[0][1]) == 2  # the cap cut the adjacent blocks into two entries
    first, second = (batch for _, batch in transport.engine.submitted)
    transport.engine.status[first] = 1  # block 0 lands; block 1 still flies
    if bad_block == 0:
        with pytest.raises(KVIntegrityError, match="block 0"):
            receiver.poll("t1")
        assert receiver.debug_state_counts()["kv_quarantined_blocks"] == 2  # entry 2 may still write
        transport.engine.status[second] = 1
        assert receiver.reclaim() == 2
        return
    assert receiver.poll("t1") is None
    assert receiver._transfers["t1"].unverified == {1}  # block 0 checked before the read ended
    transport.engine.status[second] = 1
    with pytest.raises(KVIntegrityError, match="block 1"):
        receiver.poll("t1")
    assert receiver.debug_state_counts() == {"transfers": 0, "used_blocks": 0, "kv_quarantined_blocks": 0}
    assert receiver.pool.num_used == 0
