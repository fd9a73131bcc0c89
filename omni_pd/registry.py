"""Which models omni-pd serves, and how the layers that know no model reach one.

A model package (omni_pd/models/<model>/) describes itself in one `ModelSpec` and names it in
the `omni_pd.models` entry-point group (pyproject.toml), the way vLLM finds out-of-tree models
through its plugin entry points. The config loader, the engines and the orchestrator look a
model up here, by an embedded model's name or by a checkpoint's `model_type`, and call what its
spec names; none of them imports a model package. The entry points are read once per process,
in every process that asks (stage workers are spawned and ask for themselves).

This module sits at the bottom of the layers: it imports nothing else of omni-pd.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "omni_pd.models"


@dataclass(frozen=True)
class ModelPipeline:
    """What the orchestrator knows of a model: a description it reads, not modules it imports.

    How a user's input becomes the first stage's prompt, which tokens end the text, how long the
    text stage's context is and which voices it speaks. The orchestrator routes requests along
    the stage YAML's edges with that and nothing else; the stage input processors named in the
    YAML carry the rest of the model knowledge."""

    name: str
    config: Any  # the model's top-level config (stage input processors read it)
    tokenizer: Any
    eos_token_ids: frozenset[int]  # tokens that end the text stage's output
    context_len: int  # positions the text stage's model supports
    voices: tuple[str, ...]
    # A user's input (text, chat messages, token ids, ...) -> the model's prompt object, which
    # has a `speaker`; raises ValueError naming what is wrong.
    normalize_prompt: Callable[[Any], Any]
    # That prompt object -> the first stage's prompt (an `engines.types.TokenPrompt`).
    build_prompt: Callable[[Any], Any]
    # The stage YAML's `model_stage` whose output is the request's text (the last such stage).
    text_model_stage: str = "thinker"
    # Whether the text stage's finished output has anything to speak: False (say, an answer that
    # is only its end token) ends the request with its text and no audio, as an answer, not an
    # error; the audio stages never see it.
    speaks: Callable[[Any], bool] = field(default=lambda output: True)
    # (an answer's text, seconds of its speech) -> the start of the text that those seconds say:
    # what a listener heard of an answer cut short (the Realtime API's barge-in and truncate).
    # None: the model cannot tell, and a cut answer keeps no text.
    speech_text: Callable[[str, float], str] | None = None
    # The gain before 16-bit conversion when the audio stage runs dummy (seeded random) weights:
    # None, audio_io's default (a tiny model whose random decoder is near silent); 1.0 for one
    # whose tiny decoder is built to be heard.
    dummy_weights_audio_gain: float | None = None


# The kinds of hf stage a model may have, each run by one generic engine (engines/core): an
# autoregressive stage (continuous batching over a paged KV cache, and its P/D legs), or a
# decoder fed its input in chunks.
AUTOREGRESSIVE, CHUNKED = "autoregressive", "chunked"
STAGE_KINDS = (AUTOREGRESSIVE, CHUNKED)


@dataclass(frozen=True)
class EngineArg:
    """An engine_args key a model's hf stages read: the config schema takes it from here."""

    annotation: Any  # its type, as pydantic checks it
    default: Any
    why_hf_only: str  # what a vLLM stage that sets it is told (vLLM would ignore it)


@dataclass(frozen=True)
class ModelSpec:
    """What a model package gives the generic layers. Callables import their model code when
    called, so that reading the registry stays cheap (no torch, no transformers)."""

    name: str
    # `model_type`s of the checkpoints it serves (a checkpoint directory's config.json says which).
    model_types: tuple[str, ...] = ()
    # Names of models built in code, served without a checkpoint directory.
    embedded: tuple[str, ...] = ()
    # The model (an embedded name or a checkpoint directory) -> its `ModelPipeline`; None for a
    # model that only serves as a stage's checkpoint (a vLLM stage's stand-in).
    load_pipeline: Callable[[str], ModelPipeline] | None = None
    # Engine family (`engine_args.engine`) -> builder(stage_config, model) -> a StageEngine, for
    # families whose engines are built on the model's runners (hf). vLLM's engine is generic.
    engine_builders: Mapping[str, Callable[[Any, str], Any]] = field(default_factory=dict)
    # The model stages (`engine_args.model_stage`) its hf engines run, and each one's kind.
    hf_stages: Mapping[str, str] = field(default_factory=dict)
    # engine_args keys its hf stages read beyond the generic ones (config/schema.py).
    engine_args: Mapping[str, EngineArg] = field(default_factory=dict)
    # vllm-omni engine_args keys of this model's stage files that omni-pd passes over.
    vllm_omni_engine_args: tuple[str, ...] = ()
    # vllm-omni's dotted names of this model's stage input processors -> this package's.
    processor_aliases: Mapping[str, str] = field(default_factory=dict)
    # (An embedded model's name, weights seed) -> a checkpoint directory written for engines that
    # load from disk; the seed is the one hf stages build the same model's dummy weights with.
    materialize: Callable[[str, int], str] | None = None
    # (directory, weights seed) -> the embedded tiny model written there as a checkpoint
    # (`omni-pd make-tiny-model DIR --model NAME`).
    write_tiny_checkpoint: Callable[[str, int], Any] | None = None
    # (directory, layers, weights seed, max shard bytes) -> a random checkpoint with every
    # dimension of the published model and each transformer stack cut to `layers`
    # (`omni-pd make-tiny-model DIR --model NAME --size real --layers N`); ValueError or
    # MemoryError say why it cannot be written.
    write_real_checkpoint: Callable[[str, int, int, int], Any] | None = None
    # (checkpoint directory, torch dtype, torch device, attention kernels) -> (the thinker's
    # ArRunner on that device, a callable making a request's fresh model state): what
    # `omni-pd bench roofline` and `omni-pd plan --profile-model` time the thinker's steps with.
    roofline_thinker: Callable[[str, Any, Any, str], tuple[Any, Callable[[], Any]]] | None = None
    # An embedded model's name -> the config.json it would be written with (read by config
    # checks that need a shape, e.g. the KV head count, without writing a checkpoint).
    config_dict: Callable[[str], dict[str, Any]] | None = None
    # The keys that lead from config.json to the text model's config (where its
    # num_key_value_heads is); () for a plain text checkpoint.
    text_config_keys: tuple[str, ...] = ()
    # The model (name or directory) -> an engines.vllm.hooks.VllmModelHooks for its vLLM text
    # stage, where it needs more than tokens out of vLLM; None: vLLM serves it as a text LLM.
    vllm_hooks: Callable[[str], Any] | None = None
    # vLLM architecture -> "module:Class" its hooks run: registered in vLLM's ModelRegistry by
    # omni-pd's vLLM plugin in every vLLM process (a class that behaves as vLLM's own unless the
    # engine asks for more).
    vllm_model_classes: Mapping[str, str] = field(default_factory=dict)
    # vllm-omni 0.30 deploy files' `pipeline:` names -> config.topology.Topology.
    topologies: Callable[[], Mapping[str, Any]] | None = None
    # The `pipeline:` a deploy file gets when it names none: (plain, P/D).
    default_topologies: tuple[str, str] | None = None
    # Modules a stage worker of this model imports (its engines and their transformers modeling
    # code): the server stage workers fork from imports them once (orchestrator/worker_start.py).
    worker_preload: tuple[str, ...] = ()
    # The model's C kernels (engines.hf.native_build.NativeKernel), built ahead by the setup.
    native_kernels: Callable[[], tuple[Any, ...]] | None = None
    # Served when no model is given (Omni(), `omni-pd serve` without --model).
    default: bool = False


class ModelNotFound(LookupError):
    pass


_lock = threading.Lock()
_specs: dict[str, ModelSpec] | None = None


def _load_entry_points() -> dict[str, ModelSpec]:
    found: dict[str, ModelSpec] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        spec = ep.load()
        if not isinstance(spec, ModelSpec):
            raise TypeError(
                f"entry point {ep.name} = {ep.value} in group {ENTRY_POINT_GROUP!r} "
                f"is a {type(spec).__name__}, not an omni_pd.registry.ModelSpec"
            )
        found[spec.name] = spec
    return found


def specs() -> dict[str, ModelSpec]:
    """Every registered model, by spec name."""
    global _specs
    with _lock:
        if _specs is None:
            _specs = _load_entry_points()
            log.debug("registered models: %s", ", ".join(sorted(_specs)) or "none")
        if not _specs:
            raise ModelNotFound(
                f"no model package is registered in the {ENTRY_POINT_GROUP!r} entry points: "
                "install omni-pd (`pip install -e .`, which scripts/setup.sh runs) so that its "
                "models are registered"
            )
        return _specs


def register(spec: ModelSpec) -> None:
    """Add a model in this process (tests, tools). Stage workers are spawned and read only the
    entry points: a model that stage workers must build is registered there."""
    specs()[spec.name] = spec


def default_model() -> str:
    """The embedded model served when none is given."""
    chosen = [s for s in specs().values() if s.default and s.embedded]
    if len(chosen) != 1:
        raise ModelNotFound(
            f"expected one default model among the registered ones, found {[s.name for s in chosen]}"
        )
    return chosen[0].embedded[0]


def _checkpoint_model_type(model: str) -> str | None:
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise ModelNotFound(
            f"model {model!r}: {config} is not readable JSON ({exc}); write it "
            "again (`omni-pd make-tiny-model DIR` writes a valid one)"
        ) from exc


def spec_for(model: str) -> ModelSpec:
    """The spec that serves `model`: an embedded model's name, or a checkpoint directory whose
    config.json has a registered `model_type`."""
    registered = specs()
    for spec in registered.values():
        if model in spec.embedded:
            return spec
    model_type = _checkpoint_model_type(model)
    for spec in registered.values():
        if model_type is not None and model_type in spec.model_types:
            return spec
    embedded = sorted(name for spec in registered.values() for name in spec.embedded)
    types = sorted(t for spec in registered.values() for t in spec.model_types)
    if model_type is not None:
        raise ModelNotFound(
            f"model {model!r}: its config.json has model_type {model_type!r}, "
            f"which no registered model serves (served: {', '.join(types)})"
        )
    if Path(model).expanduser().is_dir():
        raise ModelNotFound(
            f"model directory {model} has no config.json; write one with `omni-pd make-tiny-model {model}`"
        )
    raise ModelNotFound(
        f"model {model!r} is neither the embedded {' or '.join(embedded)} "
        "nor a local checkpoint directory (omni-pd never downloads from a model "
        "hub: pass a checkpoint directory)"
    )


def load_pipeline(model: str) -> ModelPipeline:
    spec = spec_for(model)
    if spec.load_pipeline is None:
        raise ModelNotFound(
            f"model {model!r} ({spec.name}) serves only as a stage's checkpoint, "
            "not as a pipeline's model; give Omni / --model a pipeline's model"
        )
    return spec.load_pipeline(model)


def engine_builder(model: str, engine: str) -> Callable[[Any, str], Any]:
    spec = spec_for(model)
    if engine not in spec.engine_builders:
        raise ModelNotFound(
            f"model {model!r} ({spec.name}) has no {engine!r} engines; it has "
            f"{', '.join(sorted(spec.engine_builders)) or 'none'}"
        )
    return spec.engine_builders[engine]


def vllm_hooks(model: str) -> Any | None:
    """The hooks a vLLM stage running `model` needs; None for a plain text LLM, or a model no
    registered package serves (a hub name vLLM resolves itself)."""
    try:
        spec = spec_for(model)
    except ModelNotFound:
        return None
    return spec.vllm_hooks(model) if spec.vllm_hooks is not None else None


def checkpoint_dir(model: str, seed: int = 0) -> str:
    """A directory an engine that loads from disk can read: an embedded model is written out by
    its package, with weights seeded by `seed`; anything else is returned as given (a
    directory, or a name the engine resolves itself)."""
    for spec in specs().values():
        if model in spec.embedded:
            if spec.materialize is None:
                raise ModelNotFound(
                    f"embedded model {model!r} cannot be written to a directory "
                    f"({spec.name} has no materialize); pass a checkpoint directory"
                )
            return spec.materialize(model, seed)
    return model


def checkpoint_config(model: str) -> dict[str, Any] | None:
    """The config.json of a model: a checkpoint directory's, or an embedded model's as its
    package would write it; None for a name only the engine resolves (a hub name)."""
    path = Path(model) / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None
    for spec in specs().values():
        if model in spec.embedded and spec.config_dict is not None:
            return spec.config_dict(model)
    return None


def text_kv_heads(model: str) -> int | None:
    """The KV head count of a model's text model (what tensor parallelism splits), from its
    config.json; None for a name only the engine resolves, or a config without it."""
    config = checkpoint_config(model)
    if config is None:
        return None
    try:
        keys = spec_for(model).text_config_keys
    except ModelNotFound:
        keys = ()
    node: Any = config
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    heads = node.get("num_key_value_heads") if isinstance(node, dict) else None
    return heads if isinstance(heads, int) and not isinstance(heads, bool) else None


def topologies() -> dict[str, Any]:
    """Every registered model's deploy-file pipelines, by `pipeline:` name."""
    found: dict[str, Any] = {}
    for spec in specs().values():
        if spec.topologies is not None:
            found.update(spec.topologies())
    return found


def default_topologies() -> tuple[str, str]:
    """The default model's (plain, P/D) deploy pipelines."""
    spec = spec_for(default_model())
    if spec.default_topologies is None:
        raise ModelNotFound(f"the default model ({spec.name}) names no default deploy pipelines")
    return spec.default_topologies


def vllm_model_classes() -> dict[str, str]:
    return {arch: cls for spec in specs().values() for arch, cls in spec.vllm_model_classes.items()}


def native_kernels() -> tuple[Any, ...]:
    return tuple(
        kernel
        for spec in specs().values()
        if spec.native_kernels is not None
        for kernel in spec.native_kernels()
    )


def worker_preload() -> list[str]:
    """Every registered model's worker modules, in registration order, each once."""
    return list(dict.fromkeys(m for spec in specs().values() for m in spec.worker_preload))


def hf_stages() -> dict[str, str]:
    """Every registered model's hf model stages and their kinds."""
    found: dict[str, str] = {}
    for spec in specs().values():
        for stage, kind in spec.hf_stages.items():
            if kind not in STAGE_KINDS:
                raise TypeError(
                    f"model {spec.name}: stage {stage!r} has kind {kind!r}, not one of "
                    f"{', '.join(STAGE_KINDS)}"
                )
            found.setdefault(stage, kind)
    return found


def model_engine_args() -> dict[str, EngineArg]:
    """Every registered model's own engine_args keys (the first model to declare a key wins)."""
    found: dict[str, EngineArg] = {}
    for spec in specs().values():
        for name, arg in spec.engine_args.items():
            found.setdefault(name, arg)
    return found


def vllm_omni_engine_args() -> frozenset[str]:
    return frozenset(key for spec in specs().values() for key in spec.vllm_omni_engine_args)


def processor_aliases() -> dict[str, str]:
    return {alias: ours for spec in specs().values() for alias, ours in spec.processor_aliases.items()}
