"""Fingerprints of the six equivalence prompts' outputs, colocated and P/D: sha256 of the thinker
token ids, the merged talker inputs, the codec codes and the audio bytes. A refactor that must not
change behaviour gives the same JSON before and after (issue 37):

    .venv/bin/python scripts/equivalence_hashes.py > before.json   # on the old commit
    .venv/bin/python scripts/equivalence_hashes.py > after.json    # on the new one
    diff before.json after.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))


def _sha(value) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    else:
        data = json.dumps(value).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def main() -> None:
    from test_pd_equivalence import _COLOCATED as COLOCATED, _PD as PD, CASES, _codes, _prompts, _talker_input

    from omni_pd.orchestrator.omni import Omni

    result = {}
    for name, path in (("colocated", COLOCATED), ("pd", PD)):
        with Omni(stage_configs_path=path, keep_stage_outputs=True) as omni:
            prompts = _prompts(omni)
            result[name] = {}
            for case in CASES:
                out = omni.generate([prompts[case]])[0]
                talker = _talker_input(omni, out)
                result[name][case] = {
                    "tokens": _sha(out.token_ids),
                    "talker_embeds": _sha(talker.thinker_embeds),
                    "talker_hidden": _sha(talker.thinker_hidden),
                    "codes": _sha(_codes(omni, out)),
                    "audio": out.audio_sha256[:16],
                }
    same = all(result["pd"][case] == result["colocated"][case] for case in CASES)
    print(json.dumps({"pd_equals_colocated": same, **result}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
