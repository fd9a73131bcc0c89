import json
import subprocess

import torch

from omni_pd.models.qwen3_omni.factory import load_model, save_tiny_model, weights_fingerprint
from omni_pd.models.qwen3_omni.tiny_config import ROLE_TOKENS, SPECIAL_TOKENS, TEXT_VOCAB_SIZE

FINGERPRINT = (
    "from omni_pd.models.qwen3_omni.factory import load_model, weights_fingerprint;"
    "print(weights_fingerprint(load_model('tiny-qwen3-omni', 'dummy', seed=42)))"
)


def test_dummy_weights_are_bit_identical_across_processes(python_exe, tiny_model):
    runs = [
        subprocess.run(
            [python_exe, "-c", FINGERPRINT], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert runs[0] == runs[1] == weights_fingerprint(tiny_model)
    # A different seed must give different weights, or the fingerprint proves nothing.
    assert weights_fingerprint(load_model("tiny-qwen3-omni", "dummy", seed=7)) != runs[0]


def test_no_parameter_left_uninitialised(tiny_model):
    for name, param in tiny_model.named_parameters():
        assert torch.isfinite(param).all(), name
        if ".experts." in name or name.endswith(".mlp.gate.weight"):
            assert param.abs().max() > 1e-4, f"{name} looks uninitialised"


def test_tokenizer_pins_special_ids_and_round_trips(tiny_tokenizer):
    for text, token_id in {**SPECIAL_TOKENS, **ROLE_TOKENS}.items():
        assert tiny_tokenizer.convert_tokens_to_ids(text) == token_id
    assert len(tiny_tokenizer) == TEXT_VOCAB_SIZE
    text = "Grüße, 世界! 123"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text
    ids = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    im_start, user, assistant = (
        SPECIAL_TOKENS["<|im_start|>"],
        ROLE_TOKENS["user"],
        ROLE_TOKENS["assistant"],
    )
    assert ids[:2] == [im_start, user] and ids[-3:-1] == [im_start, assistant]


def test_checkpoint_written_and_loaded_back_gives_the_same_outputs(tmp_path, tiny_model):
    out = save_tiny_model(tmp_path / "tiny", seed=42)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    json.loads((out / "config.json").read_text())
    loaded = load_model(str(out), "auto")
    assert weights_fingerprint(loaded.thinker) == weights_fingerprint(tiny_model.thinker)
    ids = torch.tensor([[260, 257, 10, 72, 105, 261, 10, 260, 258, 10]])
    with torch.no_grad():
        a = tiny_model.thinker(input_ids=ids).logits
        b = loaded.thinker(input_ids=ids).logits
    assert torch.equal(a, b)
