"""`omni-pd validate-config PATH`: check a stage YAML and summarise what would run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from omni_pd.config import ConfigError, PipelineConfig, load_pipeline_config
from omni_pd.config.deploy import DeployLoad, load_deploy
from omni_pd.config.engine_keys import unused_by_hf
from omni_pd.config.loader import is_deploy_document
from omni_pd.config.yaml_io import read_yaml_mapping
from omni_pd.planning import find_pd_pair

EXIT_OK = 0
EXIT_INVALID = 2


def run_validate(
    path: str,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    deploy: bool | None = None,
    platform: str | None = None,
) -> int:
    """Print a summary and return 0, or print every problem to stderr and return 2.
    `deploy`: the file is a vllm-omni 0.30 deploy file (True), a stage_args file (False), or
    either, told by its keys (None); `platform` picks a deploy file's `platforms:` section."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        if deploy is None:
            deploy = is_deploy_document(read_yaml_mapping(Path(path), path))
        loaded = load_deploy(path, platform=platform) if deploy else None
        cfg = loaded.config if loaded is not None else load_pipeline_config(path)
    except ConfigError as exc:
        print(str(exc), file=err)
        return EXIT_INVALID
    summary = summarize(cfg, path)
    if loaded is not None:
        head, _, rest = summary.partition("\n")
        summary = "\n".join([head, *deploy_lines(loaded), rest])
    print(summary, file=out)
    return EXIT_OK


def deploy_lines(loaded: DeployLoad) -> list[str]:
    """What omni-pd made of a deploy file: pipeline, platform, base files, mapped keys."""
    lines = ["deploy config (vllm-omni 0.30 schema):"]
    if len(loaded.files) > 1:
        lines.append("  base_config: " + " -> ".join(loaded.files))
    lines.extend(f"  {note}" for note in loaded.notes)
    return lines


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
            lines.append(
                f"  stage {s.stage_id}: the hf engine does not use "
                + "; ".join(f"{key} ({why})" for key, why in unused)
            )
    edges = cfg.edges()
    lines.append("edges: " + (", ".join(f"{a} -> {b}" for a, b in edges) if edges else "none"))
    if cfg.async_chunk:
        from omni_pd.orchestrator.processors import stream_processors

        streamed = stream_processors(cfg)
        lines.append(
            "async_chunk: on; streamed edges: "
            + (
                ", ".join(f"{cfg.stage(sid).engine_input_source[0]} -> {sid}" for sid in sorted(streamed))
                or "none"
            )
        )
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
