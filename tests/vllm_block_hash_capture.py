"""Golden block hashes from vLLM itself, for tests/test_vllm_block_hash.py (run as a script:
`python vllm_block_hash_capture.py SPEC.json OUT.json`; vLLM's logs go to stdout/stderr, the
results to OUT.json).

Two captures, both with vLLM's own code:
- engines: an in-process LLM (tiny Qwen3, prefix caching on) per spec entry generates one request;
  a spy on the scheduler's add_request keeps the engine's Request object, whose `block_hashes`
  the engine core's block hasher filled (prompt blocks, then decode blocks as tokens came), and
  the KV cache manager's block pool shows which hashes it cached blocks under.
- requests: vLLM `Request` objects (multimodal items, LoRA, cache salt, prompt embeddings) with
  the block hasher vLLM's engine core builds (`get_request_block_hasher`) after the same
  `init_none_hash` it calls, under each algorithm and PYTHONHASHSEED setting; output tokens are
  appended one by one as decoding does.
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: readable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def set_pythonhashseed(value):
    # vLLM reads PYTHONHASHSEED with os.getenv when it initializes NONE_HASH, not at start-up
    if value is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = value


def run_engine(entry, model_dir):
    from vllm import LLM, SamplingParams
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import get_block_hash

    set_pythonhashseed(entry["pythonhashseed"])
    kwargs = {} if entry["algo"] is None else {"prefix_caching_hash_algo": entry["algo"]}
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=512,
        block_size=entry["block_size"],
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        max_num_seqs=2,
        **kwargs,
    )
    core = llm.llm_engine.engine_core.engine_core
    seen = []
    add_request = core.scheduler.add_request

    def spy(request):
        seen.append(request)
        return add_request(request)

    core.scheduler.add_request = spy
    prompt = {"prompt_token_ids": entry["prompt_token_ids"]}
    if entry["cache_salt"]:
        prompt["cache_salt"] = entry["cache_salt"]
    params = SamplingParams(max_tokens=entry["max_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    (request,) = seen
    block_pool = core.scheduler.kv_cache_manager.block_pool
    cached = [get_block_hash(key).hex() for key in block_pool.cached_block_hash_to_block._cache]
    result = {
        "algo": core.vllm_config.cache_config.prefix_caching_hash_algo,
        "block_size": core.vllm_config.cache_config.block_size,
        "seed": kv_cache_utils.get_none_hash_seed(),
        "none_hash": kv_cache_utils.NONE_HASH.hex(),
        "all_token_ids": list(request.all_token_ids),
        "num_prompt_tokens": request.num_prompt_tokens,
        "block_hashes": [h.hex() for h in request.block_hashes],
        "cached_block_hashes": cached,
    }
    return result


def run_requests(config, requests, block_size):
    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    set_pythonhashseed(config["pythonhashseed"])
    hash_fn = get_hash_fn_by_name(config["algo"])
    kv_cache_utils.init_none_hash(hash_fn)  # what EngineCore.__init__ does
    hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
    out = {
        "seed": kv_cache_utils.get_none_hash_seed(),
        "none_hash": kv_cache_utils.NONE_HASH.hex(),
        "requests": {},
    }
    for name, spec in requests.items():
        mm = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for identifier, offset, length in spec.get("mm", [])
        ]
        lora = spec.get("lora")
        embeds = spec.get("prompt_embeds")
        request = Request(
            request_id=name,
            prompt_token_ids=spec.get("prompt_token_ids"),
            sampling_params=SamplingParams(max_tokens=64),
            pooling_params=None,
            prompt_embeds=None if embeds is None else torch.tensor(embeds, dtype=torch.float32),
            mm_features=mm or None,
            lora_request=None if lora is None else LoRARequest(lora[0], 1, lora[1]),
            cache_salt=spec.get("cache_salt"),
            block_hasher=hasher,
        )
        for token in spec.get("output_token_ids", []):
            request.append_output_token_ids(token)  # decode: hashes grow as blocks fill
        out["requests"][name] = {
            "all_token_ids": list(request.all_token_ids),
            "block_hashes": [h.hex() for h in request.block_hashes],
        }
    return out


def main():
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    result = {
        "engines": [run_engine(entry, spec["model_dir"]) for entry in spec["engines"]],
        "configs": [run_requests(config, spec["requests"], spec["block_size"]) for config in spec["configs"]],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
