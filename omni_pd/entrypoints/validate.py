"""`omni-pd validate-config PATH`: check a stage YAML and summarise what would run."""
from __future__ import annotations

import sys
from typing import TextIO

from omni_pd.config import ConfigError, PipelineConfig, load_pipeline_config
from omni_pd.config.engine_keys import unused_by_hf
from omni_pd.planning import find_pd_pair

EXIT_OK = 0
EXIT_INVALID = 2


def run_validate(path: str, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print a summary and return 0, or print every problem to stderr and return 2."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        cfg = load_pipeline_config(path)
    except ConfigError as exc:
        print(str(exc), file=err)
        return EXIT_INVALID
    print(summarize(cfg, path), file=out)
    return EXIT_OK


def summarize(cfg: PipelineConfig, path: str) -> str:
    lines = [f"{path}: OK, {len(cfg.stages)} stage(s)", "stages:"]
    for s in cfg.stages:
        role = "prefill-only" if s.is_prefill_only else "decode-only" if s.is_decode_only else "-"
        final = f"final_output={s.final_output_type or 'yes'}" if s.final_output else "final_output=no"
        inputs = list(s.engine_input_source) or "prompt"
        lines.append(
            f"  [{s.stage_id}] {s.model_stage:<9} engine={s.engine:<4} role={role:<12} "
            f"inputs={inputs} {final}"
        )
    for s in cfg.stages:
        if s.engine == "hf" and (unused := unused_by_hf(set(s.engine_args.model_fields_set))):
            lines.append(f"  stage {s.stage_id}: the hf engine does not use " + "; ".join(
                f"{key} ({why})" for key, why in unused))
    edges = cfg.edges()
    lines.append("edges: " + (", ".join(f"{a} -> {b}" for a, b in edges) if edges else "none"))
    if cfg.async_chunk:
        from omni_pd.orchestrator.processors import stream_processors
        streamed = stream_processors(cfg)
        lines.append("async_chunk: on; streamed edges: " + (", ".join(
            f"{cfg.stage(sid).engine_input_source[0]} -> {sid}" for sid in sorted(streamed)) or "none"))
    else:
        lines.append("async_chunk: off (each stage waits for its source's whole output)")
    pair = find_pd_pair(cfg)
    if pair is None:
        lines.append("P/D: no prefill/decode pair")
    else:
        kv = pair.prefill.kv_transfer_config
        connector = kv.kv_connector if kv is not None else "?"
        lines.append(
            f"P/D: prefill stage {pair.prefill_stage_id} -> decode stage {pair.decode_stage_id} "
            f"via {connector}"
        )
    return "\n".join(lines)
