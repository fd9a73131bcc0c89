"""An unmodified vLLM prefill engine (MooncakeConnector producer, omni-pd's version-checked
connector fixes only) in its own process, driven over a pipe: for tests/test_vllm_to_hf_kv.py.

Commands: ("geometry",) -> what its connector registered (layer names and indices, block size,
KV heads, head size, dtype); ("prefill", request_id, token_ids, transfer_id) -> (first token,
kv_transfer_params) with the KV kept for a decode side; ("released", transfer_id) -> whether vLLM freed
its blocks (and holds no other request's);
("close",)."""

from __future__ import annotations


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
            if cmd == "geometry":  # what the engine's prefill outputs carry (omni_pd_vllm_kv)
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                result = {
                    **engine.producer_info,
                    "block_lens": list(get_kv_transfer_group().connector_worker.block_len_per_layer),
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
