"""Fingerprints of the six equivalence prompts' outputs, colocated, P/D (pull), P/D (push) and
P/D with the prefix cache warm: sha256 of the thinker token ids, the merged talker inputs, the
codec codes and the audio bytes. A refactor that must not change behaviour gives the same JSON
before and after (issues 37 and 46):

    .venv/bin/python scripts/equivalence_hashes.py > before.json   # on the old commit
    .venv/bin/python scripts/equivalence_hashes.py > after.json    # on the new one
    diff before.json after.json

Run it again under ATEN_CPU_CAPABILITY=avx2 for the older CPU level's bits.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))


def _sha(value) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    else:
        data = json.dumps(value).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _write(data: dict, folder: Path, name: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _push(pd: Path, folder: Path) -> Path:
    # the same variant e2e/test_kv_push_pipeline.py runs: 32-token push chunks, 32-token blocks
    data = yaml.safe_load(pd.read_text())
    prefill, decode = data["stage_args"][0]["engine_args"], data["stage_args"][1]["engine_args"]
    prefill["kv_transfer_config"]["kv_connector_extra_config"].update(kv_push_chunk_tokens=32)
    decode["kv_block_size"] = 32
    decode["kv_transfer_config"]["kv_connector_extra_config"].update(transfer_mode="push")
    return _write(data, folder, "push")


def _cached(pd: Path, folder: Path) -> Path:
    data = yaml.safe_load(pd.read_text())
    for stage in data["stage_args"]:
        if stage["engine_args"].get("model_stage") == "thinker":
            stage["engine_args"]["enable_prefix_caching"] = True
    return _write(data, folder, "pd_cached")


def main() -> None:
    from test_pd_equivalence import _COLOCATED as COLOCATED, _PD as PD, CASES, _codes, _prompts, _talker_input

    from omni_pd.orchestrator.omni import Omni

    folder = Path(tempfile.mkdtemp(prefix="equivalence-"))
    layouts = {
        "colocated": (COLOCATED, 1),
        "pd": (PD, 1),
        "push": (_push(PD, folder), 1),
        # each prompt twice: the second run's prompt comes from the prefix cache
        "pd_cached": (_cached(PD, folder), 2),
    }
    result = {}
    for name, (path, runs) in layouts.items():
        with Omni(stage_configs_path=path, keep_stage_outputs=True) as omni:
            prompts = _prompts(omni)
            result[name] = {}
            for case in CASES:
                for _ in range(runs):
                    out = omni.generate([prompts[case]])[0]
                talker = _talker_input(omni, out)
                result[name][case] = {
                    "tokens": _sha(out.token_ids),
                    "talker_embeds": _sha(talker.thinker_embeds),
                    "talker_hidden": _sha(talker.thinker_hidden),
                    "codes": _sha(_codes(omni, out)),
                    "audio": out.audio_sha256[:16],
                }
    same = all(result[name][case] == result["colocated"][case] for name in layouts for case in CASES)
    print(json.dumps({"all_equal_colocated": same, **result}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
