"""Offline use of omni-pd: text and speech for a few prompts, WAVs written next to this file.

.venv/bin/python examples/offline_generate.py
"""

from pathlib import Path

from omni_pd import Omni, SamplingParams
from omni_pd.audio_io import write_wav
from omni_pd.paths import STAGE_CONFIGS_DIR

if __name__ == "__main__":
    config = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
    prompts = [
        "Tell me about the sea.",
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is a prefill engine?"},
        ],
    ]
    with Omni(model="tiny-qwen3-omni", stage_configs_path=config) as omni:
        thinker = SamplingParams(temperature=0.0, max_tokens=16)
        for i, out in enumerate(omni.generate(prompts, [thinker, None, None])):
            path = write_wav(Path(__file__).with_name(f"example_{i}.wav"), out.audio, out.sample_rate)
            print(f"{out.request_id}: {len(out.token_ids)} tokens, {out.audio.numel()} samples -> {path}")
            print(f"  metrics: {out.metrics}")
