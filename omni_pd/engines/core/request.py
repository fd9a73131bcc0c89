"""One request's whole state in an autoregressive engine, and its lifecycle.

    add_request ──> WAITING ──admit──> PREFILLING ──last chunk──> RUNNING ──finish / fail / abort──> gone
                     ▲  │                                          ▲   │
                     │  └──admit (decode leg, remote KV)──> FETCHING ──KV arrived──┘   │
                     └───────────── preempted (PREFILLING or RUNNING) ─────────────────┘

* WAITING: added, not admitted (no KV blocks held). Admission is oldest first, within the step's
  seats (`max_num_seqs`), token budget (`max_num_batched_tokens`) and free KV blocks.
* PREFILLING: admitted, its prompt computed chunk by chunk over steps (`computed` positions so
  far, in its blocks); a prompt that fits the step's budget passes through in one step.
* FETCHING (decode leg only): admitted, its prompt's KV read from the prefill engine is in
  flight; each step polls it without blocking, bounded by the request's miss window.
* RUNNING: it has its first token and decodes one token per step until the runner says it is
  finished, its blocks growing as its positions need them.
* Preempted (the pool ran out of blocks and it was the newest): its blocks are freed and it
  waits again at the front of the queue, to be computed again from its prompt. The tokens it had
  sent are kept in `replay`: computed again, they must come out the same (the engine checks),
  and nothing is sent again until it is past them.

Everything a request holds lives in its `EngineRequest`: its blocks go back to the KV manager,
and the object leaves the engine's map, on each of the three ways out. The runner keeps what its
model needs per request in `model` (nothing per request outside this object).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ...kv import KVDescriptor
from ...kv.push import PushTarget, Reservation
from ...sampling import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    FETCHING = "fetching"
    RUNNING = "running"


@dataclass
class EngineRequest:
    request_id: str
    prompt: Any  # the model's prompt record, as the stage input processor built it
    params: SamplingParams
    prompt_len: int  # positions the prompt fills (tokens, or embedding rows)
    # The prompt's token ids, when it has them: what the prefix cache names blocks by, and what
    # a repetition penalty sees. None for a prompt of embeddings.
    token_ids: list[int] | None
    stream: bool = False  # send new output as it comes (text deltas and/or chunks)
    chunks: bool = False  # send chunks for a stage that runs alongside, not only text deltas
    rows: bool = True  # False: no later stage reads its per-token rows (a text-only request)
    chunk_sizes: tuple[int, int] | None = None  # units per chunk (first, later), or every step's
    arrived: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0  # perf_counter() when it was admitted
    order: int = 0  # admission order: the newest is preempted first
    phase: Phase = Phase.WAITING
    kv: KVDescriptor | None = None  # decode leg: the remote prompt KV to fetch (None: prefill here)
    # Push mode. Decode leg: the reservation the prefill wrote the prompt's KV into (its blocks
    # are the request's from add_request on). Prefill leg: the decode side's blocks to write.
    pushed: Reservation | None = None
    # Decode leg, KV from an unmodified vLLM prefill engine (kv/vllm/source.py): its producer
    # (kv.vllm.handoff.VllmProducerInfo) and, while its blocks move, the pull (kv.vllm.pull.VllmPull).
    vllm_kv: Any = None
    vllm_pull: Any = None
    push_target: PushTarget | None = None
    # Prefill leg: the request ends with its prompt's KV published and its first token; its
    # output describes the prompt, not a generation (the decode leg's output has that).
    publishes: bool = False
    blocks: list[int] = field(default_factory=list)  # its block table: prompt, then output
    cached_len: int = 0  # prompt positions whose KV came from the prefix cache (the first blocks)
    computed: int = 0  # prompt positions whose KV is in its blocks (cached, or earlier chunks)
    # Rows (Prefilled.rows) of the prompt chunks computed so far, joined at its last chunk.
    chunk_rows: list[dict[str, Any]] = field(default_factory=list)
    chunk_ms: float = 0.0  # time of the prefill passes its chunks took part in so far
    replay: list[int] = field(default_factory=list)  # tokens sent before it was preempted
    cacheable: bool = True  # False: its blocks neither come from nor go to the prefix cache
    reused: list[int] = field(default_factory=list)  # decode leg: cached blocks while the rest moves
    # The prompt's multimodal inputs as (start, end, content key) placeholder spans, from the
    # runner; the engine derives `extra_keys` from them (per full prompt block).
    multimodal_spans: list[tuple[int, int, bytes]] = field(default_factory=list)
    extra_keys: list[bytes] = field(default_factory=list)  # per full prompt block (multimodal)
    batchable: bool = True  # False: its prefill runs alone (the runner's `prefill_alone`)
    tokens: list[int] = field(default_factory=list)  # sampled so far (the first from the prefill)
    streamed: int = 0  # tokens already sent as deltas
    chunks_sent: int = 0
    prefilled: Any = None  # its share of the step's batched prefill, until its start takes it
    error: str | None = None  # set when its own computation failed (the others go on)
    model: Any = None  # the runner's per-request state
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def prefills_here(self) -> bool:
        return self.kv is None and self.pushed is None and self.vllm_kv is None

    @property
    def position(self) -> int:
        """Where the latest token goes: prompt plus the tokens already fed back."""
        return self.prompt_len + len(self.tokens) - 1

    @property
    def seen_token_ids(self) -> list[int]:
        """The ids a repetition penalty counts: the prompt's (when it has ids) and the output's."""
        return (self.token_ids or []) + self.tokens

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1e3
