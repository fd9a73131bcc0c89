"""Typed model of a stage YAML (vllm-omni's `stage_args` format plus omni-pd's engine keys).

Pydantic v2, `extra="forbid"` and frozen everywhere except where a connector defines its own keys
(`kv_connector_extra_config`). The models check shape and types only; rules that span keys or
stages (P/D pairing, graph, imports) live in `checks.py` and the modules it runs (pair_checks.py,
worker_checks.py, ...) so that every problem can be collected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model, field_validator, model_validator

from omni_pd import registry
from omni_pd.config.cpus import cpu_sets
from omni_pd.config.engine_keys import VLLM_ENGINE_ARG_NAMES, VLLM_OMNI_ENGINE_ARG_NAMES
from omni_pd.sampling import SamplingParams

StageType = Literal["llm", "diffusion"]
EngineKind = Literal["hf", "vllm"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
FinalOutputType = Literal["text", "audio", "image", "video", "latent"]
ENGINE_OUTPUT_TYPES: frozenset[str] = frozenset({"text", "image", "audio", "latent", "token_ids"})
# Keys only omni-pd reads; never forwarded to vLLM.
OMNI_PD_ENGINE_ARG_NAMES: frozenset[str] = frozenset(
    {"engine", "kv_block_size", "kv_pool_blocks", "kv_lease_timeout_s"}
)

DEFAULT_MAX_NUM_SEQS = 64  # as vllm-omni's stage configs
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
_DOTTED_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KVConnectorExtraConfig(BaseModel):
    # Connector-specific and open-ended in vLLM, so unknown keys pass through to the connector.
    model_config = ConfigDict(extra="allow", frozen=True)

    mooncake_protocol: Literal["tcp", "rdma"] | None = None
    mooncake_bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    # hf P/D handoff faults (omni-pd's keys; the decode stage's values govern the pair).
    # How long the decode side waits for a request's KV before giving up on the peer (a frozen
    # prefill worker costs this, not Mooncake's 30 s), and the hard deadline of one handoff.
    kv_miss_window_s: float = Field(default=5.0, gt=0)
    kv_handoff_deadline_s: float = Field(default=10.0, gt=0)
    # Consecutive handoff failures that open the circuit breaker to the prefill peer, and how
    # long it stays open; what a request does meanwhile (or when its handoff fails).
    kv_breaker_threshold: int = Field(default=3, ge=1)
    kv_breaker_cooldown_s: float = Field(default=5.0, gt=0)
    kv_fallback: Literal["local_prefill", "error"] = "local_prefill"
    # How KV moves when both stages of the pair run on one host (each stage reads its own): "auto"
    # shares the prefill's cache through shared memory and the decode side copies out of it when
    # it can map it (else Mooncake, said once in the log); for stages on GPUs the same is done
    # by CUDA IPC handle, device to device. "shm" and "cuda_ipc" insist on that path (a request
    # whose KV cannot move so fails); "off" is Mooncake only.
    kv_same_host: Literal["auto", "shm", "cuda_ipc", "off"] = "auto"
    # A prefill and a decode engine that compute with different kernels (CPU level, device,
    # native build) hand over KV whose last bits the decode side would not have computed: P/D
    # output may then differ from colocated. False: one WARNING at the first handoff; true:
    # refused (the decode stage's value governs the pair).
    require_identical_kernels: StrictBool = False
    # How the hf pair's KV moves (the decode stage's value governs the pair): "pull", the decode
    # side reads the prefill's published blocks after the prefill; "push", the decode side
    # reserves the request's blocks first and the prefill writes each into them as it computes
    # it, overlapped with the rest of the prefill (docs/kv_push.md has the measurements).
    transfer_mode: Literal["push", "pull"] = "pull"
    # Push: prompt positions the prefill computes before writing what it has (a multiple of
    # both stages' kv_block_size; rounded up to one). Smaller hides more of the transfer behind
    # the rest of the prefill, at a fixed cost per chunk.
    kv_push_chunk_tokens: int = Field(default=512, ge=1)
    # An hf prefill stage whose decode stage is engine vllm: serve vLLM's MooncakeConnector
    # consumers (bootstrap /query, ZMQ side channel, blocks translated into vLLM's CPU layout;
    # docs/cross_engine_pd.md). Required on such a stage, refused on any other.
    serve_vllm_consumers: StrictBool = False
    HANDOFF_KEYS: ClassVar[tuple[str, ...]] = (
        "kv_miss_window_s",
        "kv_handoff_deadline_s",
        "kv_breaker_threshold",
        "kv_breaker_cooldown_s",
        "kv_fallback",
        "transfer_mode",
    )
    # Keys of the pair that the decode stage's value governs (a prefill stage may repeat them).
    DECODE_GOVERNED_KEYS: ClassVar[tuple[str, ...]] = HANDOFF_KEYS + ("require_identical_kernels",)

    @field_validator(
        "kv_miss_window_s",
        "kv_handoff_deadline_s",
        "kv_breaker_threshold",
        "kv_breaker_cooldown_s",
        "kv_push_chunk_tokens",
        mode="before",
    )
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        # pydantic reads `true` as 1; a flag where a number belongs is a mistake, not a 1.
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        return value

    @model_validator(mode="after")
    def _window_below_deadline(self) -> "KVConnectorExtraConfig":
        window, deadline = self.kv_miss_window_s, self.kv_handoff_deadline_s
        if window < deadline:
            return self
        # Name first the key the file set, so the issue points at it.
        if "kv_miss_window_s" in self.model_fields_set:
            raise ValueError(
                f"kv_miss_window_s ({window:g}) must be below kv_handoff_deadline_s ({deadline:g}"
                f"{'' if 'kv_handoff_deadline_s' in self.model_fields_set else ', the default'}): "
                "lower kv_miss_window_s or raise kv_handoff_deadline_s"
            )
        raise ValueError(
            f"kv_handoff_deadline_s ({deadline:g}) must be above kv_miss_window_s ({window:g}, "
            "the default): raise kv_handoff_deadline_s or lower kv_miss_window_s"
        )


class KVTransferConfig(_Model):
    """vLLM's `KVTransferConfig` fields (vllm/config/kv_transfer.py)."""

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str | None = None
    kv_buffer_size: float | None = None
    kv_role: KVRole | None = None
    kv_rank: int | None = Field(default=None, ge=0)
    kv_parallel_size: int = Field(default=1, ge=1)
    kv_ip: str | None = None
    kv_port: int | None = Field(default=None, ge=1, le=65535)
    kv_connector_extra_config: KVConnectorExtraConfig = Field(default_factory=KVConnectorExtraConfig)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool | None = None
    kv_load_failure_policy: str | None = None

    @property
    def bootstrap_port(self) -> int | None:
        """The port a peer connects to: Mooncake's bootstrap port, else the generic kv_port."""
        extra = self.kv_connector_extra_config.mooncake_bootstrap_port
        return extra if extra is not None else self.kv_port


class _TypedEngineArgs(_Model):
    """The engine_args keys omni-pd reads. Defaults follow vLLM / vllm-omni."""

    # omni-pd's own keys
    engine: EngineKind = "hf"
    kv_block_size: int = Field(default=16, ge=1)
    # hf P/D engines: blocks in the registered KV pool, and how long a prefill engine keeps a
    # published transfer's blocks when no decode engine acknowledges it.
    kv_pool_blocks: int = Field(default=1024, ge=1)
    kv_lease_timeout_s: float = Field(default=60.0, gt=0)
    # code2wav with `async_chunk`: frames in the first chunk (small: time to first audio), in
    # every later chunk, and of left context re-decoded per chunk (None: none, every layer's
    # state is carried instead; at least the decoder's receptive field, derived from the model
    # config, keeps the chunks exact too). vllm-omni's key names.
    initial_codec_chunk_frames: int = Field(default=4, ge=1)
    codec_chunk_frames: int = Field(default=25, ge=1)
    codec_left_context_frames: int | None = Field(default=None, ge=1)
    # hf autoregressive stages: a decode step's attention for all sequences in one call of
    # omni-pd's C kernel, or one torch attention call per sequence; both batch-invariant.
    attention_kernels: Literal["native", "torch"] = "native"
    # vllm-omni keys omni-pd reads
    model_stage: str
    model_arch: str | None = None
    worker_type: Literal["ar", "generation"] | None = None
    engine_output_type: str | None = None
    hf_config_name: str | None = None
    # vLLM EngineArgs keys omni-pd reads (also forwarded to vLLM when set)
    model: str | None = None
    worker_cls: str | None = None
    scheduler_cls: str | None = None
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    enforce_eager: bool = False
    trust_remote_code: bool = False
    distributed_executor_backend: Literal["mp", "ray", "uni", "external_launcher"] | None = None
    enable_prefix_caching: bool | None = None
    # vLLM's key: a prompt longer than what a step has left is computed over several steps,
    # beside the running decodes (hf engines: on unless false; prompts of a runner that cannot
    # chunk, such as the talker's, are computed whole).
    enable_chunked_prefill: bool | None = None
    # vLLM 0.32's hash of prefix-cache blocks (kv/vllm/block_hash.SUPPORTED_ALGOS). On an hf stage:
    # its prefix cache names blocks with vLLM's keys (unset: omni-pd's own xxh3-128 chain).
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] | None = None
    tensor_parallel_size: int = Field(default=1, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    load_format: str = "auto"
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    seed: int | None = None
    kv_transfer_config: KVTransferConfig | None = None

    @field_validator("engine_output_type")
    @classmethod
    def _known_output_types(cls, value: str | None) -> str | None:
        # vllm-omni allows combinations such as "text+audio"; every part must be canonical.
        if value is None:
            return value
        parts = value.replace(",", "+").split("+")
        bad = [p for p in parts if p not in ENGINE_OUTPUT_TYPES]
        if bad:
            raise ValueError(
                f"unknown engine_output_type part(s) {bad}; use {sorted(ENGINE_OUTPUT_TYPES)} "
                "or a '+'-joined combination"
            )
        return value

    def vllm_engine_kwargs(self) -> dict[str, Any]:
        """Keys explicitly set in the YAML that are vLLM `EngineArgs` names, ready for vLLM."""
        out: dict[str, Any] = {}
        for name in sorted(self.model_fields_set & VLLM_ENGINE_ARG_NAMES):
            value = getattr(self, name)
            out[name] = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
        return out


# The keys each registered model's hf stages read, typed as the model declares them.
_MODEL_KEYS = {
    name: (arg.annotation, arg.default)
    for name, arg in registry.model_engine_args().items()
    if name not in _TypedEngineArgs.model_fields
}
# The remaining allowed keys are declared as untyped optional fields (vLLM validates them) so that
# `extra="forbid"` rejects anything outside the allow-list with the key's exact location.
_PASSTHROUGH = sorted(
    (VLLM_ENGINE_ARG_NAMES | VLLM_OMNI_ENGINE_ARG_NAMES)
    - set(_TypedEngineArgs.model_fields)
    - set(_MODEL_KEYS)
)
if TYPE_CHECKING:
    # mypy cannot follow `create_model`'s dynamic fields: it sees the typed keys, and the keys the
    # registered models declare and the passthrough ones (known only at run time) as Any.
    class EngineArgsConfig(_TypedEngineArgs):
        def __getattr__(self, name: str) -> Any: ...

else:
    EngineArgsConfig = create_model(
        "EngineArgsConfig",
        __base__=_TypedEngineArgs,
        __doc__="A stage's engine_args: typed omni-pd keys (generic, and those the registered models "
        "declare) plus allow-listed vLLM / vllm-omni keys.",
        **_MODEL_KEYS,
        **{name: (Any, None) for name in _PASSTHROUGH},
    )


class StageRuntime(_Model):
    process: bool = True
    devices: str | None = None  # CUDA_VISIBLE_DEVICES-style list, e.g. "0,1"
    max_batch_size: int = Field(default=1, ge=1)
    env: dict[str, str] = Field(default_factory=dict)
    # torch threads in the stage's worker; default: one per CPU of runtime.cpus when set, else an
    # equal share of the cores per worker.
    num_threads: int | None = Field(default=None, ge=1)
    num_interop_threads: int | None = Field(default=None, ge=1)
    # omni-pd: a dead worker is restarted with a doubling backoff, unless it died more than
    # max_restarts times in restart_window_s (then it stays down and /health says why).
    max_restarts: int = Field(default=3, ge=0)
    restart_window_s: float = Field(default=60.0, gt=0)
    # A worker that sends nothing (not even its heartbeat) for this long counts as frozen.
    heartbeat_timeout_s: float = Field(default=3.0, ge=1.0)  # heartbeats come every 0.5 s
    # Workers serving this stage; the orchestrator routes each request to one by load. `devices`
    # is shared out among them (each takes tensor_parallel_size of them, in order).
    num_replicas: int = Field(default=1, ge=1)
    # With distributed_executor_backend: ray, what each of the stage's actors takes on a node:
    # custom resources (a node label such as `prefill_node: 1`), and `CPU` / `GPU` counts
    # (default: no CPU reserved, one GPU per entry of `devices`).
    ray_resources: dict[str, float] = Field(default_factory=dict)
    # The CPUs the stage's workers are pinned to (os.sched_setaffinity, at worker start; torch
    # then runs one intra-op thread per CPU unless num_threads says fewer). One set for a stage
    # of one worker: "0-3,6" (Linux's cpulist syntax), 2, or [0, 1, 2]. With num_replicas: N, a
    # list of N sets, replica k taking the k-th: ["0-1", "2-3"] or [[0, 1], [2, 3]]. A list of
    # numbers is one set. Stored as one sorted tuple per replica (config/cpus.py); the rules
    # across workers (no two share a CPU, ...) are in cpu_checks.py.
    cpus: tuple[tuple[int, ...], ...] | None = None

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpus_as_sets(cls, value: Any) -> Any:
        return None if value is None else cpu_sets(value)

    @field_validator("num_replicas", mode="before")
    @classmethod
    def _replicas_not_a_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would read `true` as 1
            raise ValueError(f"expected a whole number of replicas, got {value!r}")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_as_text(cls, value: Any) -> Any:
        # YAML reads `OMP_NUM_THREADS: 4` as a number; the environment holds text.
        if isinstance(value, dict):
            return {
                k: str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, (int, float)) else v
                for k, v in value.items()
            }
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _devices_as_text(cls, value: Any) -> Any:
        # YAML reads `devices: 0` as an int; it means the same as "0".
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class StageConfig(_Model):
    stage_id: int = Field(ge=0)
    stage_type: StageType = "llm"
    is_prefill_only: bool = False
    is_decode_only: bool = False
    is_comprehension: bool = False
    runtime: StageRuntime = Field(default_factory=StageRuntime)
    engine_args: EngineArgsConfig
    engine_input_source: tuple[int, ...] = ()
    custom_process_input_func: str | None = Field(default=None, pattern=_DOTTED_PATH)
    final_output: bool = False
    final_output_type: FinalOutputType | None = None
    default_sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    input_connectors: dict[str, str] = Field(default_factory=dict)  # {"from_stage_<id>": name}
    output_connectors: dict[str, str] = Field(default_factory=dict)  # {"to_stage_<id>": name}

    @property
    def model_stage(self) -> str:
        return self.engine_args.model_stage

    @property
    def engine(self) -> EngineKind:
        return self.engine_args.engine

    @property
    def kv_transfer_config(self) -> KVTransferConfig | None:
        return self.engine_args.kv_transfer_config

    @property
    def max_num_seqs(self) -> int:
        """Requests an engine step may hold (vLLM's meaning): engine_args.max_num_seqs, else
        vllm-omni's runtime.max_batch_size when the file sets it, else DEFAULT_MAX_NUM_SEQS."""
        if self.engine_args.max_num_seqs is not None:
            return self.engine_args.max_num_seqs
        if "max_batch_size" in self.runtime.model_fields_set:
            return self.runtime.max_batch_size
        return DEFAULT_MAX_NUM_SEQS

    @property
    def max_num_batched_tokens(self) -> int:
        """Tokens one engine step may process (vLLM's meaning): a decode costs one token, a
        prompt chunk its positions. With chunked prefill off, this also bounds the longest
        prompt."""
        value = self.engine_args.max_num_batched_tokens
        return value if value is not None else DEFAULT_MAX_NUM_BATCHED_TOKENS


class EdgeDefaults(_Model):
    window_size: int = Field(default=-1, ge=-1)  # -1: whole output at once
    max_inflight: int = Field(default=1, ge=1)


class EdgeConfig(_Model):
    from_stage: int = Field(alias="from")
    to_stage: int = Field(alias="to")
    window_size: int | None = Field(default=None, ge=-1)
    max_inflight: int | None = Field(default=None, ge=1)  # vllm-omni's per-edge key


class ConnectorSpec(_Model):
    name: str
    extra: dict[str, Any] = Field(default_factory=dict)


class PipelineRuntime(_Model):
    enabled: bool = True
    defaults: EdgeDefaults = Field(default_factory=EdgeDefaults)
    connectors: dict[str, ConnectorSpec] = Field(default_factory=dict)
    edges: tuple[EdgeConfig, ...] = ()


class PipelineConfig(_Model):
    stage_args: tuple[StageConfig, ...] = Field(min_length=1)
    runtime: PipelineRuntime | None = None
    async_chunk: bool = False

    @property
    def stages(self) -> tuple[StageConfig, ...]:
        return self.stage_args

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """Stage ids in file order (the order per-stage lists such as sampling params follow)."""
        return tuple(s.stage_id for s in self.stage_args)

    def stage(self, stage_id: int) -> StageConfig:
        for s in self.stage_args:
            if s.stage_id == stage_id:
                return s
        raise KeyError(f"no stage with stage_id {stage_id}; stages are {list(self.stage_ids)}")

    def edges(self) -> tuple[tuple[int, int], ...]:
        """(source, destination) pairs from engine_input_source and runtime.edges, deduplicated."""
        pairs: list[tuple[int, int]] = []
        for s in self.stage_args:
            pairs.extend((src, s.stage_id) for src in s.engine_input_source)
        if self.runtime is not None:
            pairs.extend((e.from_stage, e.to_stage) for e in self.runtime.edges)
        return tuple(dict.fromkeys(pairs))

    def final_output_stages(self) -> tuple[StageConfig, ...]:
        return tuple(s for s in self.stage_args if s.final_output)
