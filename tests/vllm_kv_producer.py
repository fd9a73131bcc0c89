"""An unmodified vLLM prefill engine (MooncakeConnector producer, omni-pd's version-checked
connector fixes only) in its own process, driven over a pipe: for tests/test_vllm_to_hf_kv.py.

Commands: ("geometry",) -> what its connector registered (layer names and indices, block size,
KV heads, head size, dtype); ("prefill", request_id, token_ids, transfer_id) -> (first token,
kv_transfer_params) with the KV kept for a decode side; ("released", transfer_id) -> whether vLLM freed
its blocks (and holds no other request's);
("close",)."""

from __future__ import annotations


def _attention_isa(engine) -> str:
    """The CPU attention kernel vLLM picked for the model's attention layers (`layer.isa`)."""
    core = engine.engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context.values()
    (isa,) = {layer.isa for layer in layers if hasattr(layer, "isa")}
    return isa


def serve(config_path: str, conn) -> None:
    from omni_pd import SamplingParams
    from omni_pd.config import load_pipeline_config
    from omni_pd.engines.types import TokenPrompt
    from omni_pd.engines.vllm.engine import build_vllm_engine
    from omni_pd.models.qwen3_omni.tiny_config import TINY_MODEL_NAME
    from omni_pd.planning import build_prefill_sampling_params

    stage = load_pipeline_config(config_path).stages[0]
    engine = build_vllm_engine(stage, TINY_MODEL_NAME)
    conn.send(("ok", None))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "geometry":
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                worker = get_kv_transfer_group().connector_worker
                first = next(iter(worker.device_kv_caches.values()))
                blocks, heads, block_size, channels = first.shape  # vLLM CPU: LBHNC, K|V rows
                result = {
                    "layer_names": list(worker.registered_layer_names),
                    "layer_indices": list(worker.registered_layer_indices),
                    "block_size": block_size,
                    "num_kv_heads": heads,
                    "head_size": channels // 2,
                    "dtype": str(first.dtype).removeprefix("torch."),
                    "attention_isa": _attention_isa(engine),
                    "block_lens": list(worker.block_len_per_layer),
                }
            elif cmd == "prefill":
                request_id, ids, transfer_id = args
                params = build_prefill_sampling_params(
                    SamplingParams(temperature=0.0, max_tokens=8), transfer_id
                )
                out = engine.generate(request_id, TokenPrompt(list(ids)), params)
                result = (out.token_ids[0], out.kv_transfer_params)
            elif cmd == "released":  # vLLM freed the transfer's blocks (bounded wait)
                result = engine.release_kv(args[0], timeout_s=10.0) and engine._held() == 0
            elif cmd == "close":
                engine.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("ok", result))
