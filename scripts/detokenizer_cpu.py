"""The orchestrator's detokenizing CPU time for one streamed answer of N tokens (issue 48, item 5):
the incremental detokenizer against decoding the whole token list again at every token (what it
replaced), on the tiny Qwen3-Omni's byte-level tokenizer, text with multi-byte characters and a
stop string that never occurs (so it is searched for at every token).

    .venv/bin/python scripts/detokenizer_cpu.py [N]   # N: 4096
"""

from __future__ import annotations

import random
import sys
import time

from omni_pd.models.qwen3_omni.factory import load_tokenizer, resolve_model
from omni_pd.orchestrator.detokenizer import IncrementalDetokenizer
from omni_pd.sampling import SamplingParams


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    tokenizer = load_tokenizer(resolve_model("tiny-qwen3-omni"))
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz,.é😀") for _ in range(2 * n))
    ids = tokenizer.encode(text)[:n]
    params = SamplingParams(stop=("zzqq",))

    began = time.process_time()
    detokenizer = IncrementalDetokenizer(tokenizer, params, set())
    streamed = "".join(detokenizer.add([i]) for i in ids)
    incremental = time.process_time() - began

    began = time.process_time()
    for end in range(1, len(ids) + 1):  # the whole list again at every token
        whole = tokenizer.decode(ids[:end], skip_special_tokens=True)
    quadratic = time.process_time() - began
    assert whole.startswith(streamed), "the incremental text is not the whole decode's"

    for name, seconds in (("whole list at every token", quadratic), ("incremental", incremental)):
        print(
            f"{name:>26}: {seconds * 1e3:7.0f} ms CPU for {len(ids)} tokens ({seconds / len(ids) * 1e6:.1f} us/token)"
        )
    print(f"{'ratio':>26}: {quadratic / incremental:7.1f}x")


if __name__ == "__main__":
    main()
