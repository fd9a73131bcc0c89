"""Build or load a Qwen3-Omni-MoE model and its tokenizer.

`model` is either the embedded name `tiny-qwen3-omni` or a checkpoint directory. With
`load_format="dummy"` the weights are seeded random numbers, bit-identical in every process:
transformers leaves the talker's MoE experts as `torch.empty` and its router at zeros, so those are
filled from a generator seeded by the parameter's name.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3OmniMoeConfig, WhisperFeatureExtractor
from transformers import Qwen3OmniMoeForConditionalGeneration

from ..checkpoint_cache import cached_checkpoint, content_key
from ..checkpoint import LoadReport, read_shard_index
from .stage_parts import StageParts, load_stage_parts
from .medium_config import medium_config_dict
from .tiny_config import TINY_MODEL_NAME, tiny_config_dict
from .tokenizer import build_tiny_tokenizer

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy", "safetensors")
DEFAULT_DUMMY_SEED = 0


class _RopeKeysFilter(logging.Filter):
    # The talker's rope config legitimately carries mrope keys its validator does not list.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unrecognized keys in `rope_parameters`" not in record.getMessage()


logging.getLogger("transformers").addFilter(_RopeKeysFilter())
for _name in ("transformers.modeling_rope_utils", "transformers.configuration_utils"):
    logging.getLogger(_name).addFilter(_RopeKeysFilter())


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config and tokenizer come from."""

    name: str
    directory: Path | None  # None: the embedded tiny model

    @property
    def is_embedded(self) -> bool:
        return self.directory is None


def resolve_model(model: str) -> ModelSource:
    if model == TINY_MODEL_NAME:
        return ModelSource(name=model, directory=None)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {path} has no config.json; write one with `omni-pd make-tiny-model {path}`"
            )
        return ModelSource(name=model, directory=path.resolve())
    raise FileNotFoundError(
        f"model {model!r} is neither the embedded {TINY_MODEL_NAME!r} nor a local directory "
        "(omni-pd never downloads from a model hub: pass a checkpoint directory)"
    )


def load_config(source: ModelSource) -> Qwen3OmniMoeConfig:
    if source.is_embedded:
        return Qwen3OmniMoeConfig(**tiny_config_dict())
    return Qwen3OmniMoeConfig.from_pretrained(str(source.directory))


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    if source.is_embedded:
        return build_tiny_tokenizer()
    return AutoTokenizer.from_pretrained(str(source.directory))


def _seeded_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


@torch.no_grad()
def _fill_uninitialised(model: torch.nn.Module, seed: int, std: float) -> None:
    for name, param in model.named_parameters():
        if ".experts." in name or name.endswith(".mlp.gate.weight"):
            param.copy_(torch.randn(param.shape, generator=_seeded_generator(seed, name)) * std)


def build_dummy_model(
    config: Qwen3OmniMoeConfig, seed: int = DEFAULT_DUMMY_SEED, dtype: torch.dtype = torch.float32
) -> Qwen3OmniMoeForConditionalGeneration:
    """Seeded random weights; the same seed gives the same bytes in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(config)
    _fill_uninitialised(model, seed, std=config.thinker_config.initializer_range)
    return model.to(dtype).eval()


def load_model(
    model: str, load_format: str = "auto", seed: int = DEFAULT_DUMMY_SEED, dtype: torch.dtype = torch.float32
) -> Qwen3OmniMoeForConditionalGeneration:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use one of {LOAD_FORMATS}")
    source = resolve_model(model)
    if load_format == "dummy":
        return build_dummy_model(load_config(source), seed=seed, dtype=dtype)
    if source.is_embedded:
        raise ValueError(
            f"the embedded {TINY_MODEL_NAME!r} has no weight files: use load_format "
            "'dummy', or write a checkpoint with `omni-pd make-tiny-model DIR`"
        )
    loaded = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(source.directory), dtype=dtype)
    # safetensors can map tensors at misaligned addresses, which changes the last bit of some
    # CPU kernels' results; owning fresh aligned copies keeps outputs equal to a seeded build.
    with torch.no_grad():
        for param in loaded.parameters():
            param.data = param.data.clone()
    return loaded.eval()


def load_stage(
    model: str,
    stage: str,
    load_format: str = "auto",
    seed: int = DEFAULT_DUMMY_SEED,
    dtype: torch.dtype = torch.float32,
) -> tuple[StageParts, list[LoadReport]]:
    """The modules `stage` runs. From a checkpoint directory: only that stage's part, read lean
    (see stage_parts). `dummy`: the whole seeded model is built (tiny; its bytes depend on
    building every part in order) and only the stage's part is kept (no reports)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use one of {LOAD_FORMATS}")
    source = resolve_model(model)
    if load_format == "dummy":
        return StageParts.of(build_dummy_model(load_config(source), seed=seed, dtype=dtype), stage), []
    if source.is_embedded:
        raise ValueError(
            f"the embedded {TINY_MODEL_NAME!r} has no weight files: use load_format "
            "'dummy', or write a checkpoint with `omni-pd make-tiny-model DIR`"
        )
    index = read_shard_index(source.directory)
    return load_stage_parts(index, load_config(source), stage, dtype)


MODEL_SIZES = ("tiny", "medium")


def model_config_dict(size: str = "tiny") -> dict:
    if size == "tiny":
        return tiny_config_dict()
    if size == "medium":
        return medium_config_dict()
    raise ValueError(f"model size {size!r} is not one of {MODEL_SIZES}")


def save_tiny_model(
    directory: str | os.PathLike,
    seed: int = DEFAULT_DUMMY_SEED,
    size: str = "tiny",
    max_shard_size: str | int | None = None,
) -> Path:
    """Write a seeded random model (config, tokenizer, weights) as a checkpoint: the embedded
    tiny one, or `medium` (1.1 GB of float32, parts sized like the real model's). With
    `max_shard_size` (e.g. "200MB") the weights go in HF's sharded layout
    (`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`); without, in one file."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model = build_dummy_model(Qwen3OmniMoeConfig(**model_config_dict(size)), seed=seed)
    # One file unless asked: save_pretrained's own default would shard at 50 GB anyway.
    model.save_pretrained(str(out), max_shard_size=max_shard_size or "1000GB")
    build_tiny_tokenizer().save_pretrained(str(out))
    return out


def save_tiny_processor(directory: str | os.PathLike) -> None:
    """The multimodal processor files vLLM builds its Qwen3-Omni input processing from (the
    tokenizer with its audio / image / video tokens named, a Whisper feature extractor with the
    prompt builder's settings, Qwen2-VL's image and video processors), into a directory that
    `save_tiny_model` wrote (its tokenizer is reloaded from there). Needs torchvision, as the
    vLLM extra installs it."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3OmniMoeProcessor

    from .prompt import AUDIO_SAMPLE_RATE

    config = tiny_config_dict()["thinker_config"]
    tokenizer = AutoTokenizer.from_pretrained(
        str(directory),
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    features = WhisperFeatureExtractor(
        feature_size=config["audio_config"]["num_mel_bins"], sampling_rate=AUDIO_SAMPLE_RATE
    )
    Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        feature_extractor=features,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    ).save_pretrained(str(directory))


def ensure_tiny_checkpoint(seed: int = DEFAULT_DUMMY_SEED) -> Path:
    """The embedded tiny model as a checkpoint directory for vLLM (what `save_tiny_model` writes,
    plus the processor files), built once per machine in omni-pd's cache: vLLM then runs the
    same weights as the hf stages' `load_format: dummy` with the same seed."""

    def write(directory: Path) -> None:
        save_tiny_model(directory, seed=seed)
        save_tiny_processor(directory)

    key = content_key({"config": tiny_config_dict(), "seed": seed, "v": 2})
    return cached_checkpoint(TINY_MODEL_NAME, key, write)


def weights_fingerprint(module: torch.nn.Module) -> str:
    """xxh3-128 over every parameter's and buffer's name and bytes, in state_dict order."""
    digest = xxhash.xxh3_128()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(
            tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        )
    return digest.hexdigest()
