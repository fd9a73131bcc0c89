"""A vLLM engine for a thinker-like LLM stage (`engine_args.engine: vllm`).

Runs inside the stage's worker process: an in-process `LLMEngine`
(`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless the stage's `runtime.env` says otherwise), token ids in,
`TextOutput` out. `engine_args` minus omni-pd's own keys go to vLLM's `EngineArgs`,
`kv_transfer_config` included, so a P/D pair is two of these engines over vLLM's
MooncakeConnector with omni-pd's fixes (patches/) applied.

Requests are submitted to the `LLMEngine` as they arrive (`add_request`) and stepped together:
each `step()` is one `LLMEngine.step()`, so vLLM's scheduler batches every request it holds, and
the step's `RequestOutput`s become token deltas (streamed requests) and one final record or
error per request. Each request has a deadline, checked every step, and a decode leg that loads
remote KV a bound on its wait for that KV: `kv_transfer_params["kv_wait_s"]` when the orchestrator
sets it (the pair's `kv_miss_window_s`, cut to the handoff's and the request's deadlines), else
`kv_lease_timeout_s` + a margin. Past it the leg is aborted in vLLM and fails with
KVTransferFailed, which the orchestrator counts against the pair's breaker and answers from the
fallback. vLLM keeps the aborted request's blocks until its connector has settled the receive
(a late write from the prefill engine cannot land in blocks that another request holds); the
drain thread steps the engine until then, and the consumer_peer_watch fix ends the receive
early when the prefill engine is gone (docs/vllm_pd_faults.md). Stepping
and reading vLLM's scheduler happen under the offline_drain patch's per-engine lock, the lock its
background thread steps under while a prefill engine has KV sends pending and no request left.
That thread starts only from inside a step, so an abort that leaves no request takes one idle
step itself (a prefill that finished in the last step still needs one to announce its send), and
`release_kv` waits for the thread only while no request is in flight (otherwise the worker's own
steps free the blocks, and it cannot step while it waits there).

Ports: a producer's Mooncake bootstrap server listens on
`kv_connector_extra_config.mooncake_bootstrap_port` when the YAML sets it, else on a free port
picked at start-up (vLLM reads it from `VLLM_MOONCAKE_BOOTSTRAP_PORT`, set here in the worker
process). The prefill output's `remote_bootstrap_addr` tells the decode side where it is, so
nothing is hard-coded and two test runs at once do not collide. The Mooncake transfer engine and
the connector's ZMQ side channel pick their own free ports.

`kv_lease_timeout_s` keeps its hf meaning: on a producer it becomes
`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT` (how long KV waits for its decode side, and how long a decode
request for KV that was never published waits before it is answered with an error); on a
consumer it bounds the wait for KV (plus a margin for the producer's answer).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ... import hops, registry
from ...sampling import SamplingParams
from ..base import StageEngine, StepOutput
from ..core.text import TextStops
from ..types import TextOutput, TokenPrompt
from ...kv.errors import KVIncompatibleError
from ...kv.vllm.handoff import (
    HF_KV_KEY,
    VLLM_KV_KEY,
    VllmProducerInfo,
    check_protocol_version,
    check_vllm_consumer,
)
from .hooks import LegRole, VllmModelHooks
from .patches import recv_wake
from .resume import FIRST_TOKEN_KEY, eos_token_ids, resume_from
from ...kv.vllm.producer_info import log_producer_info, producer_info
from .rows import EXTENSION as ROWS_EXTENSION
from .rows import ROWS_ARG, RequestRows, check_vllm_version

if TYPE_CHECKING:  # vLLM is optional: imported where it runs
    from vllm.inputs import TokensPrompt
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: ~3 s start-up, not ~30
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "MC_LOG_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
}
CONSUMER_WAIT_MARGIN_S = 10.0
IDLE_STEP_SLEEP_S = 0.001  # a step that ran nothing: the worker waits this long before the next
# Every request waits for its KV and the connector wakes the worker when a receive ends
# (patches/recv_wake.py): the longest wait between steps, for the deadlines checked per step.
KV_WAIT_S = 0.05


class KVTransferFailed(RuntimeError):
    """The decode leg did not get its KV cache from the prefill engine."""


def free_port(host: str = "0.0.0.0") -> int:
    """A port nothing listens on right now (the OS picks it). Another process could take it before
    the bootstrap server binds; set mooncake_bootstrap_port in the YAML to rule that out."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def resolve_vllm_model(name: str, seed: int | None) -> str:
    """An embedded model written out by its package; else a directory or a hub name, which
    vLLM resolves itself."""
    return registry.checkpoint_dir(name, seed if seed is not None else 0)


def to_vllm_sampling_params(params: SamplingParams, rows: bool = True, skip_cache: bool = False):
    """`rows` False: the model records no rows for the request (rows.py). `skip_cache`: the
    request's prompt is computed whole, whatever vLLM's prefix cache holds (its blocks are
    still cached for later requests)."""
    import vllm

    extra: dict[str, Any] = (
        {"kv_transfer_params": dict(params.kv_transfer_params)} if params.kv_transfer_params else {}
    )
    if not rows:
        extra[ROWS_ARG] = False
    return vllm.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k in (-1, 0) else params.top_k,
        max_tokens=params.max_tokens,
        seed=params.seed,
        repetition_penalty=params.repetition_penalty,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        # Only stop strings need vLLM's text (it searches it for them); any other request's
        # text is decoded once at its end (VllmEngine._text): the orchestrator detokenizes the
        # stream itself, so vLLM's per-step detokenizing would be work done twice.
        detokenize=vllm_detokenizes(params),
        skip_reading_prefix_cache=True if skip_cache else None,
        extra_args=extra or None,
    )


def vllm_detokenizes(params: SamplingParams) -> bool:
    return params.detokenize and bool(params.stop)


@dataclass
class _RequestState:
    """What the engine keeps per request between steps (vLLM keeps the rest)."""

    request_id: str  # the caller's id; vLLM's RequestOutput.request_id
    vllm_id: str  # vLLM's internal id (request_id plus a random suffix)
    prompt_token_ids: list[int]
    kv_in: dict[str, Any]  # the request's kv_transfer_params
    loads_remote: bool  # a decode leg: its prompt's KV comes from a prefill engine
    deadline: float  # time.monotonic() after which the request is aborted
    # A decode leg: time.monotonic() by which its KV must have arrived (its first token), the
    # wait it was given; None once the KV is in (or for a leg that computes its prompt).
    kv_deadline: float | None
    kv_wait_s: float
    began: float  # time.perf_counter() at add_request
    stream: bool
    role: LegRole
    chunks: bool = False  # send the model's chunks too (a downstream stage runs alongside)
    seen: int = 0  # output tokens seen so far
    first_token_ms: float | None = None
    remote_tokens: int = 0  # prompt tokens the scheduler loads over the KV connector
    rows: RequestRows = field(default_factory=RequestRows)  # the model's per-token rows
    rows_streamed: int = 0  # position up to which rows left in chunks
    chunks_sent: int = 0
    multimodal: bool = False  # the prompt has multimodal inputs
    reads_cache: bool = False  # its prompt may be served from vLLM's prefix cache (counted in load())
    # A decode leg that starts from the prefill's first token (resume.py): that token, put in
    # front of vLLM's output (and of its first delta).
    resumed: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)  # the caller's, for the text
    stamps: dict[str, float] = field(default_factory=dict)  # its hops (hops.py)


class VllmEngine(StageEngine):
    control_calls = frozenset({"debug_state_counts", "release_kv", "patch_status"})

    def __init__(self, stage, model: str, hooks: VllmModelHooks | None = None):
        self.stage_id = stage.stage_id
        self.engine: LLMEngine | None = None  # None once closed
        self.hooks = hooks or VllmModelHooks()
        self._requests: dict[str, _RequestState] = {}
        for key, value in {**ENV_DEFAULTS, **stage.runtime.env}.items():
            if key in stage.runtime.env:
                os.environ[key] = value
            else:
                os.environ.setdefault(key, value)
        args = stage.engine_args
        kwargs: dict[str, Any] = self._with_kv_transfer(
            args.vllm_engine_kwargs(), float(args.kv_lease_timeout_s)
        )
        if (
            self.hooks.records_rows
            and kwargs.get("enable_prefix_caching")
            and self.kv_role in ("kv_consumer", "kv_both")
        ):
            # Its prompt's KV comes from the prefill leg; local hits would make vLLM's connector
            # pull only part of it, a path the handoff's checks ("no KV loaded") do not cover.
            raise ValueError(
                f"stage {self.stage_id}: engine_args.enable_prefix_caching is true on a vLLM decode "
                f"stage ({self.kv_role}) of a model that records rows for a later stage; its prompt's KV comes "
                "from the prefill stage, where the prefix cache may be on: remove it here or set it false"
            )
        self._check_connector_patches()

        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        name = kwargs.pop("model", None) or model
        self.model_dir = resolve_vllm_model(name, args.seed)
        kwargs = _with_model_kwargs(self.stage_id, kwargs, self.hooks)
        self.prefix_caching = kwargs.get("enable_prefix_caching") is not False  # vLLM's default: on
        self._prefix_queries = self._prefix_hits = 0  # prompt tokens looked up / found, since start
        if self.hooks.records_rows:
            check_vllm_version()
        began = time.perf_counter()
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=self.model_dir, **kwargs))
        if self.hooks.records_rows:
            self.engine.collective_rpc("omni_pd_attach_rows")
        self.startup_s = time.perf_counter() - began
        self._eos_ids = eos_token_ids(self.engine)
        self._stops: TextStops | None = None  # _text's decoder
        self._read_kv_description(name, args.tensor_parallel_size)
        self._idle = False  # the last step ran nothing while requests were held
        # A consumer whose connector worker is in this process (TP 1) wakes on its receives.
        self._waker = (
            recv_wake.open_waker()
            if self.kv_connector == "MooncakeConnector"
            and self.kv_role in ("kv_consumer", "kv_both")
            and args.tensor_parallel_size == 1
            and recv_wake.PATCH.apply().ok
            else None
        )
        log.info(
            "stage %d: vLLM engine for %s up in %.1f s (kv_role %s, bootstrap port %s)",
            self.stage_id,
            name,
            self.startup_s,
            self.kv_role,
            self.bootstrap_port,
        )

    def _with_kv_transfer(self, kwargs: dict[str, Any], kv_wait_s: float) -> dict[str, Any]:
        """The engine kwargs with this process's kv_transfer_config: its role, connector and
        engine id read, a producer's bootstrap port chosen (and told to the connector)."""
        kv = kwargs.get("kv_transfer_config")
        self.kv_role = kv.get("kv_role") if kv else None
        self.kv_connector = kv.get("kv_connector") if kv else None
        self.kv_wait_s = kv_wait_s
        self.bootstrap_port: int | None = None
        if kv:
            kv = kwargs["kv_transfer_config"] = dict(kv)
            extra = dict(kv.get("kv_connector_extra_config") or {})
            port = extra.pop("mooncake_bootstrap_port", None)
            kv["kv_connector_extra_config"] = extra
            # One id per engine process: a restarted producer listens on a new bootstrap port and
            # holds new memory, and a consumer caches what it learnt of a peer by engine id; under
            # the YAML's id alone it kept asking the dead process (every handoff after a
            # restart expired). The YAML's id stays the readable prefix.
            kv["engine_id"] = f"{kv.get('engine_id') or f'omni-pd-stage{self.stage_id}'}-{os.getpid()}"
            if self.kv_role in ("kv_producer", "kv_both"):
                self.bootstrap_port = int(port) if port is not None else free_port()
                os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(self.bootstrap_port)
                os.environ["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(max(1, math.ceil(self.kv_wait_s)))
        self.engine_id = kv.get("engine_id") if kv else None
        return kwargs

    def _check_connector_patches(self) -> None:
        from .plugin import register
        from .patches import results

        # The entry point does this too; explicit so a bare checkout works in-process. It also
        # registers the registered models' vLLM classes (the hooks' model class among them).
        register()
        if self.kv_connector == "MooncakeConnector":
            refused = [r.detail for r in results().values() if not r.ok]
            if refused:
                raise RuntimeError(
                    "stage %d cannot run a MooncakeConnector P/D leg on this vLLM:\n  %s"
                    % (self.stage_id, "\n  ".join(refused))
                )

    def _read_kv_description(self, name: str, tensor_parallel_size: int) -> None:
        """A producer tells a non-vLLM decode side its KV geometry and block keys; a consumer
        checks an hf producer's against its own; both log them. Read from the connector worker in
        this process: with tensor_parallel_size > 1 the workers are vLLM's rank processes and
        there is none here, and no cross-engine pair reads such an engine (the config check holds
        an hf stage to TP 1 and a cross-engine pair to one TP size)."""
        self.producer_info: dict[str, Any] | None = None
        self.consumer_info: VllmProducerInfo | None = None
        self._hf_producers: list[dict[str, Any]] = []  # hf producers accepted (their HF_KV_KEY)
        roles = {"kv_producer": "prefill", "kv_consumer": "decode"}
        if self.kv_connector == "MooncakeConnector" and self.kv_role in roles and tensor_parallel_size == 1:
            assert self.engine is not None, "read once the engine is up"
            info = producer_info(self.engine, name)
            log_producer_info(self.stage_id, info, role=roles[self.kv_role])
            if self.kv_role == "kv_producer":
                self.producer_info = info.to_dict()
            else:
                self.consumer_info = info

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: TokenPrompt,
        params: SamplingParams,
        stream: bool = False,
        chunks: bool = False,
        chunk_sizes: tuple[int, int] | None = None,
        rows: bool = True,
    ) -> None:
        """`chunks`: the model's hooks build a chunk per step (a talker runs alongside); a
        model whose hooks build none streams tokens only, and a stage it feeds starts when it
        has finished (its stream processor falls back to the whole output)."""
        if self.engine is None:
            raise RuntimeError(f"stage {self.stage_id}: the vLLM engine is closed")
        self.hooks.check_prompt(self.stage_id, prompt)
        if request_id in self._requests:
            raise ValueError(
                f"stage {self.stage_id}: request {request_id} is already running here; "
                "give each request its own id"
            )
        token_ids = list(prompt.prompt_token_ids)
        kv_in = dict(params.kv_transfer_params or {})
        loads_remote = bool(kv_in.get("do_remote_prefill"))
        if loads_remote and HF_KV_KEY in kv_in:
            self._check_hf_producer(kv_in[HF_KV_KEY])
        began = time.perf_counter()
        now = time.monotonic()
        deadline = now + max(self.kv_wait_s, 60.0) + 600.0
        kv_wait_s = self._kv_wait_s(request_id, kv_in) if loads_remote else 0.0
        # LLMEngine.add_request takes the drain lock itself (patches/offline_drain.py).
        # The hooks build a vLLM TokensPrompt (a TypedDict) as a plain dict.
        plain = self.hooks.vllm_prompt(prompt)
        resume = resume_from(kv_in, params, len(token_ids), self._eos_ids) if loads_remote else None
        if resume is not None:
            plain, params_in = resume.vllm_prompt(plain), resume.params(params)
        else:
            params_in = params
        vllm_prompt = cast("TokensPrompt", plain)
        # A prompt position served from the prefix cache is never computed, so it records no
        # row: a request whose rows a later stage reads computes its prompt whole. (Not a decode
        # leg's: vLLM's connector loads nothing for a request that skips the cache.)
        skip_cache = self.hooks.records_rows and rows and not loads_remote
        vllm_id = self.engine.add_request(
            request_id, vllm_prompt, to_vllm_sampling_params(params_in, rows, skip_cache)
        )
        first = [resume.first_token] if resume is not None else []
        role = LegRole(computes_prompt=not loads_remote, decodes=not kv_in.get("do_remote_decode"), rows=rows)
        self._requests[request_id] = _RequestState(
            request_id=request_id,
            vllm_id=vllm_id,
            prompt_token_ids=token_ids,
            kv_in=kv_in,
            loads_remote=loads_remote,
            deadline=deadline,
            kv_deadline=now + kv_wait_s if loads_remote else None,
            kv_wait_s=kv_wait_s,
            began=began,
            stream=bool(stream),
            role=role,
            chunks=bool(stream and chunks),
            multimodal=prompt.has_multimodal_inputs(),
            reads_cache=self.prefix_caching and not skip_cache and not loads_remote,
            resumed=first,
            params=params,
            stamps={hops.PREFIX + "added": began},
        )

    def _check_hf_producer(self, described: Any) -> None:
        """omni-pd's hf prefill engine as this consumer's producer: its blocks (translated into
        vLLM's CPU layout) and block keys must be this engine's; refused by name at the first
        handoff (kv/vllm/handoff.py), once per producer description."""
        if described in self._hf_producers:
            return
        if self.consumer_info is None:
            raise KVIncompatibleError(
                f"stage {self.stage_id}: KV from an hf prefill engine needs a vLLM decode stage with "
                f"kv_connector MooncakeConnector, kv_role kv_consumer and tensor_parallel_size 1 "
                f"(this one: {self.kv_connector}, {self.kv_role}, "
                f"{self.engine.vllm_config.parallel_config.tensor_parallel_size if self.engine else '?'})"
            )
        check_protocol_version(self.consumer_info.vllm_version, "vLLM decode engine")
        check_vllm_consumer(VllmProducerInfo.from_dict(described), self.consumer_info)
        self._hf_producers.append(described)
        log.info("stage %d: hf prefill producer accepted (%s)", self.stage_id, described.get("model"))

    def _kv_wait_s(self, request_id: str, kv_in: dict[str, Any]) -> float:
        """How long a decode leg waits for its KV: the orchestrator's `kv_wait_s` (the pair's miss
        window, cut to the handoff's and the request's deadlines), else the stage's
        kv_lease_timeout_s plus a margin for the producer's answer."""
        value = kv_in.get("kv_wait_s")
        if value is None:
            return self.kv_wait_s + CONSUMER_WAIT_MARGIN_S
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise ValueError(
                f"stage {self.stage_id}: request {request_id}: kv_transfer_params['kv_wait_s'] "
                f"must be a number of seconds >= 0, got {value!r:.80}"
            )
        return float(value)

    def abort_request(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None or self.engine is None:
            return
        self._abort_in_vllm(state)
        self._hand_over_to_drain()

    def _live(self) -> LLMEngine:
        """The vLLM engine, which close() drops (with every request)."""
        if self.engine is None:
            raise RuntimeError(f"stage {self.stage_id}: the vLLM engine is closed")
        return self.engine

    def _abort_in_vllm(self, state: "_RequestState") -> None:
        # vLLM's id is internal (the caller's id plus a random suffix): internal=True, or vLLM
        # would look it up as an external id, find nothing, and abort nothing.
        self._live().abort_request([state.vllm_id], internal=True)

    def _hand_over_to_drain(self) -> None:
        """After an abort that leaves no request: the worker stops stepping, but a prefill that
        finished in the last step still needs a step to announce its KV send to vLLM's worker
        (and later ones to see it done). The patched `LLMEngine.step` starts the drain thread
        when a step leaves such work and no unfinished request, so take that one step here."""
        if self._requests:
            return  # step() keeps stepping
        from .patches.offline_drain import _state, pending_connector_work

        engine = self._live()
        with _state(engine).lock:
            if engine.get_num_unfinished_requests() == 0 and pending_connector_work(engine):
                try:
                    engine.step()  # no request is unfinished: no output to lose
                except Exception:  # an abort must not fail; the KV lease expires on its own
                    log.exception("stage %d: stepping vLLM after an abort failed", self.stage_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def step(self) -> list[StepOutput]:
        if not self._requests:
            return []
        from .patches.offline_drain import _state

        # One lock for stepping and for reading the scheduler: the drain thread of a prefill
        # engine steps under it too (the patched LLMEngine.step re-enters it; it is an RLock).
        engine = self._live()  # close() drops the requests: there are none once it is gone
        with _state(engine).lock:
            # A generation model's engine gives RequestOutputs (no pooling outputs).
            outputs = cast("list[RequestOutput]", engine.step() if engine.has_unfinished_requests() else [])
            if self.hooks.records_rows and any(s.role.rows for s in self._requests.values()):
                self._take_rows()
            # Taken while vLLM still holds the request: a finished decode leg is gone from the
            # scheduler (see _external_tokens).
            for held in self._requests.values():
                if held.loads_remote and not held.remote_tokens:
                    held.remote_tokens = self._external_tokens(held.vllm_id)
                if held.loads_remote and hops.PREFIX + "kv landed" not in held.stamps:
                    self._stamp_kv_wait(held)
            vllm_unfinished = engine.get_num_unfinished_requests()
        now = time.perf_counter()
        results: list[StepOutput] = []
        for out in outputs:
            state = self._requests.get(out.request_id)  # RequestOutput.request_id: the caller's id
            if state is None:
                continue
            completion = out.outputs[0] if out.outputs else None
            fresh = list(completion.token_ids[state.seen :]) if completion is not None else []
            new = [*state.resumed, *fresh] if fresh and state.seen == 0 else fresh
            state.seen += len(fresh)
            if new and state.first_token_ms is None:
                state.first_token_ms = (now - state.began) * 1e3
            for index in range(1, min(len(state.resumed) + state.seen if state.seen else 0, 2) + 1):
                hops.stamp(state.stamps, f"token {index}", now)
            if new or out.finished:
                state.kv_deadline = None  # the KV is in (or the leg is over): no more KV wait
            record = StepOutput(request_id=state.request_id, new_token_ids=new if state.stream else [])
            if state.chunks and (new or out.finished):
                record.chunk = self._chunk(state, new)
            if out.finished:
                del self._requests[state.request_id]
                try:
                    record.output = self._final_output(state, out)
                except Exception as exc:  # this request's failure only
                    record = StepOutput.failed(state.request_id, f"{type(exc).__name__}: {exc}")
                record.finished = True
            if record.new_token_ids or record.finished or record.chunk is not None:
                results.append(record)
        if self._requests and not vllm_unfinished:
            # Cannot happen while vLLM and this engine agree; fail rather than step forever.
            for state in list(self._requests.values()):
                del self._requests[state.request_id]
                results.append(
                    StepOutput.failed(
                        state.request_id,
                        (
                            f"RuntimeError: stage {self.stage_id}: vLLM no longer holds request "
                            f"{state.request_id} and gave no final output for it"
                        ),
                    )
                )
        now_mono = time.monotonic()
        expired = [
            s
            for s in self._requests.values()
            if now_mono > s.deadline or (s.kv_deadline is not None and now_mono > s.kv_deadline)
        ]
        for state in expired:
            del self._requests[state.request_id]
            self._abort_in_vllm(state)
            results.append(StepOutput.failed(state.request_id, self._expired_error(state)))
        if expired:
            self._hand_over_to_drain()
        # Nothing ran (a decode leg waits for its KV): the worker waits (step_delay_s) rather
        # than step again at once.
        self._idle = not outputs and bool(self._requests)
        return results

    def step_delay_s(self) -> float:
        if not self._idle:
            return 0.0
        return KV_WAIT_S if self._waker is not None and self._all_await_kv() else IDLE_STEP_SLEEP_S

    def wake_fd(self) -> int | None:
        return self._waker

    def _all_await_kv(self) -> bool:
        """Every request held waits for a KV receive that has not ended: only the connector's
        wake (or a deadline) gives the next step something to do."""
        from vllm.v1.request import RequestStatus

        from .patches.offline_drain import _inproc_scheduler, _state

        scheduler = _inproc_scheduler(self.engine)
        if scheduler is None:
            return False
        with _state(self.engine).lock:
            if scheduler.finished_recving_kv_req_ids or scheduler.failed_recving_kv_req_ids:
                return False
            held = [scheduler.requests.get(s.vllm_id) for s in self._requests.values()]
            return all(r is not None and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in held)

    def _take_rows(self) -> None:
        """The rows the model recorded in this step, onto their requests (by vLLM's id)."""
        taken = self._live().collective_rpc("omni_pd_take_rows")[0]
        if not taken:
            return
        by_vllm_id = {s.vllm_id: s for s in self._requests.values()}
        for vllm_id, pieces in taken.items():
            state = by_vllm_id.get(vllm_id)
            if state is not None:  # an aborted request's last rows are dropped
                for start, tensors in pieces:
                    state.rows.add(start, tensors)

    def _chunk(self, state: "_RequestState", new: list[int]) -> Any:
        made = self.hooks.chunk(
            state.prompt_token_ids,
            new,
            state.rows,
            state.rows_streamed,
            state.role,
            first=state.chunks_sent == 0,
        )
        if made is None:
            return None
        chunk, state.rows_streamed = made
        state.chunks_sent += 1
        return chunk

    def _expired_error(self, state: "_RequestState") -> str:
        waited = time.perf_counter() - state.began
        if state.kv_deadline is not None:
            source = "kv_wait_s from the orchestrator" if "kv_wait_s" in state.kv_in else "kv_lease_timeout_s"
            return (
                f"KVTransferFailed: stage {self.stage_id}: request {state.request_id} waited "
                f"{waited:.1f} s for its KV cache (transfer {state.kv_in.get('transfer_id')} from "
                f"engine {state.kv_in.get('remote_engine_id')}) and got none; its wait was "
                f"{state.kv_wait_s:g} s ({source}); the prefill leg reported "
                f"{_published(state.kv_in)}"
            )
        return f"TimeoutError: stage {self.stage_id}: request {state.request_id} took over {waited:.0f} s"

    def _final_output(self, state: "_RequestState", final) -> TextOutput:
        request_id, kv_in = state.request_id, state.kv_in
        if not final.outputs:
            raise RuntimeError(f"stage {self.stage_id}: request {request_id} finished without a completion")
        completion = final.outputs[0]
        expanded = len(final.prompt_token_ids or ()) - len(state.resumed)
        if expanded and expanded != len(state.prompt_token_ids):
            # vLLM expands multimodal placeholders itself: its count must be the prompt builder's,
            # or every position after the first placeholder is misplaced.
            raise RuntimeError(
                f"stage {self.stage_id}: request {request_id}: vLLM expanded the "
                f"prompt to {expanded} tokens, the prompt builder to "
                f"{len(state.prompt_token_ids)}"
            )
        # RequestOutput.num_cached_tokens of a decode leg is the *prefill* engine's prefix-cache hit
        # count (vLLM copies remote_prefill_cached_tokens into it), so the tokens loaded over the
        # connector are read from the scheduler's prefill stats instead (sampled every step).
        cached = state.remote_tokens
        if state.loads_remote and (completion.finish_reason not in ("stop", "length") or cached == 0):
            raise KVTransferFailed(
                f"stage {self.stage_id}: request {request_id} got no KV cache from the prefill "
                f"engine for transfer {kv_in.get('transfer_id')} (finish_reason "
                f"{completion.finish_reason!r}, prompt tokens loaded: {cached}); "
                f"the prefill leg reported {_published(kv_in)}"
            )
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"stage {self.stage_id}: request {request_id} ended with "
                f"finish_reason {completion.finish_reason!r}"
            )
        metrics = {"e2e_ms": (time.perf_counter() - state.began) * 1e3, **state.stamps}
        # The prompt positions vLLM's prefix cache gave, as the hf engine counts them (a decode
        # leg's num_cached_tokens is the prefill engine's count).
        if not state.loads_remote:
            local_hits = int(final.num_cached_tokens or 0)
            metrics["prefix_cached_tokens"] = local_hits
            if state.reads_cache:  # set only where the prompt is computed here
                self._prefix_queries += len(state.prompt_token_ids)
                self._prefix_hits += local_hits
        if state.first_token_ms is not None:
            metrics["first_token_ms"] = state.first_token_ms
        token_ids = [*state.resumed, *completion.token_ids]
        text = TextOutput(
            request_id=request_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=token_ids,
            text=self._text(state, token_ids, completion.text),
            finish_reason=completion.finish_reason,
            kv_transfer_params=self._kv_out(state, final, completion),
            num_cached_prompt_tokens=cached if state.loads_remote else 0,
            metrics=metrics,
        )
        return self.hooks.output(text, state.rows, state.role)

    def _text(self, state: "_RequestState", token_ids: list[int], vllm_text: str | None) -> str:
        """vLLM's text where it detokenized (stop strings: never a leg that started from the
        prefill's first token), else the whole answer decoded once by the hf engine's own
        `TextStops.detokenize` (EOS and stop token ids left out, special tokens skipped, a
        trailing half character kept as U+FFFD, where vLLM's detokenizer drops it)."""
        if vllm_detokenizes(state.params):
            return vllm_text or ""
        if not state.params.detokenize:
            return ""
        if self._stops is None:  # the tokenizer, only once a request needs its text
            self._stops = TextStops(self._live().get_tokenizer(), self._eos_ids)
        return self._stops.detokenize(token_ids, state.params)

    def _kv_out(self, state: "_RequestState", final, completion) -> dict[str, Any] | None:
        """The request's kv_transfer_params out; a prefill leg's carry, besides vLLM's keys, what
        a decode engine that is not vLLM needs: the first token, the model's handoff state, the
        producer's KV geometry and block keys, and whether its blocks may be named for reuse (not
        a prompt with multimodal inputs: vLLM keys those by its own processor's hashes)."""
        if not final.kv_transfer_params:
            return None
        out = dict(final.kv_transfer_params)
        if not state.role.decodes and completion.token_ids:
            # Any decode leg starts from it (a vLLM one too: resume.py).
            out[FIRST_TOKEN_KEY] = int(completion.token_ids[0])
        if not state.role.decodes and self.producer_info is not None and completion.token_ids:
            out.update(
                kv_cacheable=not state.multimodal,
                **self.hooks.handoff_state(state.prompt_token_ids),
            )
            out[VLLM_KV_KEY] = self.producer_info
        return out

    # ---- control ---------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        import vllm

        return {
            "engine": "vllm",
            "vllm_version": vllm.__version__,
            "kv_role": self.kv_role,
            "takes_multimodal_prompts": self.hooks.takes_multimodal_prompts,
            "engine_id": self.engine_id,
            "bootstrap_port": self.bootstrap_port,
            "startup_s": round(self.startup_s, 3),
        }

    def patch_status(self) -> dict[str, str]:
        from .patches import results

        return {name: r.status for name, r in results().items()}

    def _stamp_kv_wait(self, state: "_RequestState") -> None:
        """A decode leg's KV hops, as its scheduler saw them after a step: its receive started
        (the request waits for remote KV) and ended (it no longer does)."""
        from vllm.v1.request import RequestStatus

        from .patches.offline_drain import _inproc_scheduler

        scheduler = _inproc_scheduler(self.engine)
        request = scheduler.requests.get(state.vllm_id) if scheduler is not None else None
        if request is None:
            return
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            hops.stamp(state.stamps, "kv read started")
            if state.vllm_id in scheduler.finished_recving_kv_req_ids:  # scheduled next step
                hops.stamp(state.stamps, "kv landed")
        elif hops.PREFIX + "kv read started" in state.stamps:
            hops.stamp(state.stamps, "kv landed")

    def _external_tokens(self, vllm_id: str) -> int:
        """Prompt tokens the scheduler plans to load over the KV connector for a request (set when
        it is first scheduled, taken with its first output); 0 when not known (yet)."""
        from .patches.offline_drain import _inproc_scheduler

        scheduler = _inproc_scheduler(self.engine)
        request = scheduler.requests.get(vllm_id) if scheduler is not None else None
        stats = getattr(request, "prefill_stats", None)
        return int(getattr(stats, "num_external_cached_tokens", 0) or 0)

    def _held(self, transfer_id: str | None = None) -> int:
        """Finished requests whose blocks vLLM still holds for a KV send (all, or one transfer)."""
        from .patches.offline_drain import _inproc_scheduler, _state

        scheduler = _inproc_scheduler(self.engine)
        if scheduler is None:
            return 0
        with _state(self.engine).lock:
            held = [r for r in scheduler.requests.values() if r.is_finished()]
            if transfer_id is not None:
                held = [r for r in held if (r.kv_transfer_params or {}).get("transfer_id") == transfer_id]
            return len(held)

    def release_kv(self, transfer_id: str, timeout_s: float = 2.0) -> bool:
        """vLLM frees a prefill's blocks itself once they are sent (or expire). Called after the
        decode leg: wait (bounded) until that has happened, so no state outlives the request.
        True when the blocks are free, False when vLLM still holds them (they expire after
        kv_lease_timeout_s).

        Waits only while this engine holds no request: then the drain thread steps vLLM. With
        requests in flight only the worker's own step() calls advance the send, and they cannot
        run while the worker is in here, so it answers at once (the next steps free the blocks)."""
        if self._requests:
            return not self._held(transfer_id)
        end = time.monotonic() + timeout_s
        while self._held(transfer_id):
            if time.monotonic() > end:
                return False
            time.sleep(0.005)  # polling vLLM's scheduler, which the drain thread steps
        return True

    def load(self) -> dict[str, int]:
        load = super().load()
        if self.prefix_caching:  # counters since start, as the hf engine's: Prometheus derives the hit rate
            load.update(prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits)
        return load

    def debug_state_counts(self) -> dict[str, int]:
        from .patches.offline_drain import _inproc_scheduler, _state

        engine = self._live()
        scheduler = _inproc_scheduler(engine)
        counts = {"vllm.engine_requests": len(self._requests)}
        if scheduler is None:
            return {**counts, "vllm.unfinished_requests": int(engine.get_num_unfinished_requests())}
        with _state(engine).lock:
            return {
                **counts,
                "vllm.requests": len(scheduler.requests),
                "vllm.unfinished_requests": int(engine.get_num_unfinished_requests()),
            }

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        self.engine = None
        self._requests.clear()
        waker, self._waker = getattr(self, "_waker", None), None
        if waker is not None:
            recv_wake.close_waker(waker)
        from .patches.offline_drain import stop_draining

        stop_draining(engine)
        try:
            engine.engine_core.shutdown()
        except Exception:
            log.debug("stage %d: vLLM shutdown raised", self.stage_id, exc_info=True)


def _published(kv_in: dict[str, Any]) -> str:
    flag = kv_in.get("omni_pd_kv_published")
    if flag is None:
        return "nothing about publishing its KV"
    status = kv_in.get("omni_pd_finish_status", "?")
    return (
        "its KV as published"
        if flag
        else f"its KV as NOT published (it finished as {status}, not length-capped: were its "
        "stop conditions neutralised?)"
    )


def _with_model_kwargs(stage_id: int, kwargs: dict[str, Any], hooks: VllmModelHooks) -> dict[str, Any]:
    """The stage's EngineArgs plus what the model's hooks need; a clash is refused by name."""
    wanted = dict(hooks.engine_kwargs())
    merged = dict(kwargs)
    if hooks.records_rows:
        wanted["worker_extension_cls"] = ROWS_EXTENSION
        # Off unless the stage turns it on (vLLM's default is on). On, it serves text-only
        # requests only (add_request: a request that records rows computes its prompt whole),
        # and nothing makes vLLM's kernels batch-invariant: a prompt computed over cached blocks
        # is not guaranteed to equal it computed whole (on the tiny CPU thinker they agreed to
        # the bit), where the hf engine's cache is exact by design.
        merged.setdefault("enable_prefix_caching", False)
    for key, value in wanted.items():
        if key == "additional_config":
            merged[key] = {**(merged.get(key) or {}), **value}
        elif key in merged and merged[key] != value:
            raise ValueError(
                f"stage {stage_id}: engine_args.{key} is {merged[key]!r}, but this "
                f"model's vLLM stage needs {value!r}; remove it or set it to {value!r}"
            )
        else:
            merged[key] = value
    return merged


def build_vllm_engine(stage, model: str, hooks: VllmModelHooks | None = None) -> StageEngine:
    if stage.stage_type != "llm":
        raise ValueError(
            f"stage {stage.stage_id}: engine vllm runs LLM stages only, not stage_type {stage.stage_type!r}"
        )
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        from . import INSTALL_HINT

        raise RuntimeError(f"stage {stage.stage_id} has engine: vllm, but {INSTALL_HINT} ({exc})") from exc
    return VllmEngine(stage, model, hooks)
