"""Admission control without a server: slots up to the capacity, a bounded FIFO queue, a 429 at
once past it, and every slot back however its request ends."""

from __future__ import annotations

import asyncio
import gc

import pytest

from omni_pd.entrypoints.openai.admission import AdmissionControl
from omni_pd.entrypoints.openai.protocol import APIError


def test_capacity_then_queue_then_429_and_fifo_hand_over():
    async def scenario():
        control = AdmissionControl(capacity=2, max_queued=2)
        a, b = await control.enter(), await control.enter()
        order = []

        async def waiter(name):
            slot = await control.enter()
            order.append(name)
            return slot

        first = asyncio.ensure_future(waiter("first"))
        second = asyncio.ensure_future(waiter("second"))
        await asyncio.sleep(0)  # let both reach the queue (an event-loop turn, not a wait)
        assert control.counts() == {"admission.running": 2, "admission.queued": 2}
        with pytest.raises(APIError) as refused:
            await control.enter()
        error = refused.value
        assert error.status == 429 and error.headers == {"Retry-After": "1"}
        assert error.body.error.code == "server_overloaded" and control.rejected == 1
        a.release()
        a.release()  # once only
        slot = await first
        assert order == ["first"] and control.counts()["admission.running"] == 2
        b.release()
        other = await second
        assert order == ["first", "second"]
        slot.release(), other.release()
        assert control.counts() == {"admission.running": 0, "admission.queued": 0}

    asyncio.run(scenario())


def test_a_waiter_cancelled_in_line_leaves_no_trace():
    async def scenario():
        control = AdmissionControl(capacity=1, max_queued=1)
        held = await control.enter()
        waiting = asyncio.ensure_future(control.enter())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert control.counts() == {"admission.running": 1, "admission.queued": 0}
        held.release()
        assert control.counts() == {"admission.running": 0, "admission.queued": 0}

    asyncio.run(scenario())


def test_a_slot_tied_to_a_body_that_never_starts_comes_back_when_it_is_collected():
    async def scenario():
        control = AdmissionControl(capacity=1, max_queued=0)
        slot = await control.enter()

        async def body():
            yield "never"

        stream = body()
        slot.release_with(stream)
        del stream
        gc.collect()
        assert control.counts()["admission.running"] == 0
        with pytest.raises(APIError):  # the negative control: a held slot refuses the next
            held = await control.enter()
            await control.enter()
        held.release()

    asyncio.run(scenario())


def test_bad_limits_are_refused_by_name():
    with pytest.raises(ValueError, match="--max-queued-requests must be 0 or more, got -1"):
        AdmissionControl(capacity=4, max_queued=-1)
