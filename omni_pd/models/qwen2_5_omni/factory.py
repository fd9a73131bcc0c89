"""Build or load a Qwen2.5-Omni model, its tokenizer and its voices.

`model` is the embedded name `tiny-qwen2.5-omni` or a checkpoint directory. A seeded build
(`load_format: dummy`) gives the same bytes in every process. A checkpoint holds, besides the
config and weights, `spk_dict.pt`: per voice the thinker token its speech starts from, the
speaker embedding and the reference mel token2wav is conditioned on (transformers'
`from_pretrained` refuses a checkpoint without it).
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2_5OmniConfig
from transformers import Qwen2_5OmniForConditionalGeneration

from ..checkpoint import LoadReport, read_shard_index
from ..checkpoint_cache import cached_checkpoint, content_key
from .stage_parts import StageParts, load_stage_parts
from .tiny_config import (
    DEFAULT_SEED,
    REF_MEL_FRAMES,
    SPEAKER_EMBEDDING,
    TINY_MODEL_NAME,
    VOICES,
    tiny_config_dict,
)
from .tokenizer import build_tiny_tokenizer

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy", "safetensors")
SPEAKERS_FILE = "spk_dict.pt"


class _TalkerVocabFilter(logging.Filter):
    # The talker config checks thinker-vocabulary ids (tts text tokens, multimodal markers)
    # against its codec vocabulary: the real config trips it too.
    def filter(self, record: logging.LogRecord) -> bool:
        return "must be `None` or an integer within the vocabulary" not in record.getMessage()


for _name in ("transformers", "transformers.configuration_utils"):
    logging.getLogger(_name).addFilter(_TalkerVocabFilter())


@dataclass(frozen=True)
class ModelSource:
    name: str
    directory: Path | None  # None: the embedded tiny model

    @property
    def is_embedded(self) -> bool:
        return self.directory is None


def resolve_model(model: str) -> ModelSource:
    if model == TINY_MODEL_NAME:
        return ModelSource(model, None)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(model, path.resolve())
    raise FileNotFoundError(
        f"model {model!r} is neither the embedded {TINY_MODEL_NAME!r} nor a checkpoint directory "
        "with a config.json (write one with `omni-pd make-tiny-model DIR --model qwen2_5_omni`)"
    )


def load_config(source: ModelSource) -> Qwen2_5OmniConfig:
    if source.is_embedded:
        return Qwen2_5OmniConfig(**tiny_config_dict())
    return Qwen2_5OmniConfig.from_pretrained(str(source.directory))


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    if source.is_embedded:
        return build_tiny_tokenizer()
    return AutoTokenizer.from_pretrained(str(source.directory))


def seeded_speakers(
    seed: int, embedding: int = SPEAKER_EMBEDDING, ref_frames: int = REF_MEL_FRAMES
) -> dict[str, dict[str, Any]]:
    """The tiny model's voices, as spk_dict.pt holds them: random conditioning from `seed`
    (a real-shape checkpoint's are as wide and as long as the published ones)."""
    generator = torch.Generator().manual_seed(seed * 7919 + 17)
    return {
        voice: {
            "bos_token": bos,
            "cond": torch.randn(1, embedding, generator=generator),
            "ref_mel": torch.randn(1, ref_frames, 80, generator=generator),
        }
        for voice, bos in VOICES.items()
    }


def find_voice(speakers: dict[str, dict[str, Any]], voice: str | None) -> dict[str, Any]:
    """A voice's entry of spk_dict.pt, matched case-insensitively (the server lower-cases voices);
    ValueError naming the voices."""
    by_name = {name.lower(): spec for name, spec in speakers.items()}
    spec = by_name.get((voice or "").lower())
    if spec is None:
        raise ValueError(f"voice {voice!r} is not one of this model's voices: {sorted(by_name)}")
    return spec


def load_speakers(source: ModelSource, seed: int = DEFAULT_SEED) -> dict[str, dict[str, Any]]:
    if source.is_embedded:
        return seeded_speakers(seed)
    path = source.directory / SPEAKERS_FILE  # type: ignore[operator]
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {source.directory} has no {SPEAKERS_FILE} (the voices: each one's bos "
            "token, speaker embedding and reference mel); copy it from the model's release"
        )
    return torch.load(path, weights_only=True)


VOCODER_GAIN = 0.7  # per layer: the tiny vocoder's speech peaks near 0.4 (measured)


@torch.no_grad()
def audible_vocoder(token2wav: torch.nn.Module, seed: int) -> None:
    """transformers' init (std 0.02) leaves the vocoder's stack of narrowing convolutions with an
    output near 1e-8: silence. Each convolution is drawn again, seeded by its name, with a std of
    gain / sqrt(fan-in), so a random model's speech is audible noise a demo can play."""
    for name, module in token2wav.code2wav_bigvgan_model.named_modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            weight = module.weight
            if isinstance(module, torch.nn.Conv1d):
                fan_in = weight.shape[1] * weight.shape[2]
            else:
                fan_in = weight.shape[0] * weight.shape[2] / module.stride[0]
            generator = torch.Generator().manual_seed(
                (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
            )
            weight.copy_(torch.randn(weight.shape, generator=generator) * VOCODER_GAIN / fan_in**0.5)


def build_dummy_model(
    config: Qwen2_5OmniConfig, seed: int = DEFAULT_SEED, dtype: torch.dtype = torch.float32
) -> Qwen2_5OmniForConditionalGeneration:
    """Seeded random weights (transformers' init from the seeded global generator; the vocoder's
    convolutions scaled to be heard); token2wav stays float32, as transformers runs it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5OmniForConditionalGeneration(config)
    if model.has_talker:
        audible_vocoder(model.token2wav, seed)
    model.speaker_map = seeded_speakers(seed)
    model = model.to(dtype).eval()
    if model.has_talker:
        model.token2wav.float()
    return model


def _source(model: str, load_format: str) -> ModelSource:
    """`model` resolved for `load_format`; a format it cannot load from is refused by name (the
    embedded tiny model has no weight files to read)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use one of {LOAD_FORMATS}")
    source = resolve_model(model)
    if load_format != "dummy" and source.is_embedded:
        raise ValueError(
            f"the embedded {TINY_MODEL_NAME!r} has no weight files: use load_format 'dummy', or "
            "write a checkpoint with `omni-pd make-tiny-model DIR --model qwen2_5_omni`"
        )
    return source


def load_model(
    model: str, load_format: str = "auto", seed: int = DEFAULT_SEED, dtype: torch.dtype = torch.float32
) -> Qwen2_5OmniForConditionalGeneration:
    source = _source(model, load_format)
    if load_format == "dummy":
        return build_dummy_model(load_config(source), seed, dtype)
    loaded = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(source.directory), dtype=dtype)
    # safetensors can map tensors at misaligned addresses, which moves the last bit of some CPU
    # kernels' results: fresh aligned copies keep outputs equal to a seeded build.
    with torch.no_grad():
        for param in loaded.parameters():
            param.data = param.data.clone()
    return loaded.eval()


def load_stage(
    model: str,
    stage: str,
    load_format: str = "auto",
    seed: int = DEFAULT_SEED,
    dtype: torch.dtype = torch.float32,
) -> tuple[StageParts, list[LoadReport]]:
    """The modules `stage` runs. From a checkpoint directory: only that stage's part, read lean
    (see stage_parts). `dummy`: the whole seeded model is built (tiny; its bytes depend on
    building every part in order) and only the stage's part is kept (no reports)."""
    source = _source(model, load_format)
    if load_format == "dummy":
        return StageParts.of(build_dummy_model(load_config(source), seed, dtype), stage), []
    return load_stage_parts(read_shard_index(source.directory), load_config(source), stage, dtype)


def save_tiny_model(
    directory: str | os.PathLike, seed: int = DEFAULT_SEED, max_shard_size: str = "1000GB"
) -> Path:
    """The embedded tiny model as a checkpoint: config, weights (one file, or shards of at most
    `max_shard_size` with an index, as real checkpoints are), tokenizer and voices."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model = build_dummy_model(Qwen2_5OmniConfig(**tiny_config_dict()), seed)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    torch.save(seeded_speakers(seed), out / SPEAKERS_FILE)
    build_tiny_tokenizer().save_pretrained(str(out))
    return out


def save_tiny_processor(directory: str | os.PathLike) -> None:
    """The multimodal processor files vLLM builds its Qwen2.5-Omni input processing from (the
    tokenizer with its audio / image / video tokens named, a Whisper feature extractor, Qwen2-VL's
    image and video processors), into a directory `save_tiny_model` wrote. Needs torchvision, as
    the vLLM extra installs it."""
    from transformers import (
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    from omni_pd.models.omni_prompt import AUDIO_SAMPLE_RATE

    tokenizer = AutoTokenizer.from_pretrained(
        str(directory),
        extra_special_tokens={
            "image_token": "<|IMAGE|>",
            "audio_token": "<|AUDIO|>",
            "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>",
            "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
    )
    mel_bins = tiny_config_dict()["thinker_config"]["audio_config"]["num_mel_bins"]
    Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        feature_extractor=WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=AUDIO_SAMPLE_RATE),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    ).save_pretrained(str(directory))


def ensure_tiny_checkpoint(seed: int = DEFAULT_SEED) -> Path:
    """The embedded tiny model written once per machine in omni-pd's cache (for vLLM: with the
    processor files), with the weights the hf stages build from the same seed."""

    def write(directory: Path) -> None:
        save_tiny_model(directory, seed)
        save_tiny_processor(directory)

    key = content_key({"config": tiny_config_dict(), "seed": seed, "v": 2})
    return cached_checkpoint(TINY_MODEL_NAME, key, write)
