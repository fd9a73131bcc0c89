"""Allow-lists for `engine_args` keys that omni-pd does not model itself.

`engine_args` is a stage's engine configuration. omni-pd types the keys it reads (see
`schema.EngineArgsConfig`); every other key must be named here, so a typo is an error instead of
being silently ignored by an engine.

- `VLLM_ENGINE_ARG_NAMES`: field names of vLLM's `EngineArgs` dataclass (vllm/engine/arg_utils.py,
  v0.11-era, plus those vLLM 0.32.0 has: `moe_backend`, `attention_config`, ...), minus private
  `_api_*` fields. Forwarded to vLLM for `engine: vllm` stages.
- `VLLM_OMNI_ENGINE_ARG_NAMES`: keys vllm-omni adds in `OmniEngineArgs` (vllm_omni/engine/
  arg_utils.py), and those a model's stage files carry (`ModelSpec.vllm_omni_engine_args`).
  Accepted so vllm-omni stage files load; omni-pd does not forward them to vLLM.

When vLLM adds an engine argument, add its name to the first set.
"""
from __future__ import annotations

from omni_pd import registry

VLLM_ENGINE_ARG_NAMES: frozenset[str] = frozenset(
    {
        # model
        "model", "served_model_name", "tokenizer", "hf_config_path", "runner", "convert", "task",
        "skip_tokenizer_init", "enable_prompt_embeds", "tokenizer_mode", "trust_remote_code",
        "allowed_local_media_path", "allowed_media_domains", "config_format", "dtype", "seed",
        "max_model_len", "max_logprobs", "logprobs_mode", "revision", "code_revision",
        "rope_scaling", "rope_theta", "hf_token", "hf_overrides", "tokenizer_revision",
        "quantization", "enforce_eager", "disable_sliding_window", "disable_cascade_attn",
        "logits_processor_pattern", "pooler_config", "override_pooler_config",
        "generation_config", "enable_sleep_mode", "override_generation_config", "model_impl",
        "override_attention_dtype", "logits_processors", "io_processor_plugin",
        # load
        "download_dir", "safetensors_load_strategy", "load_format", "model_loader_extra_config",
        "ignore_patterns", "use_tqdm_on_load", "pt_load_map_location",
        # cache
        "kv_cache_dtype", "block_size", "enable_prefix_caching", "prefix_caching_hash_algo",
        "swap_space", "cpu_offload_gb", "gpu_memory_utilization", "kv_cache_memory_bytes",
        "num_gpu_blocks_override", "calculate_kv_scales", "mamba_cache_dtype",
        "mamba_ssm_cache_dtype", "mamba_block_size", "kv_sharing_fast_prefill",
        # compilation / cuda graphs
        "cuda_graph_sizes", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
        "compilation_config",
        # parallel
        "distributed_executor_backend", "pipeline_parallel_size", "tensor_parallel_size",
        "decode_context_parallel_size", "data_parallel_size", "data_parallel_rank",
        "data_parallel_start_rank", "data_parallel_size_local", "data_parallel_address",
        "data_parallel_rpc_port", "data_parallel_hybrid_lb", "data_parallel_backend",
        "enable_expert_parallel", "all2all_backend", "enable_dbo", "dbo_decode_token_threshold",
        "dbo_prefill_token_threshold", "disable_nccl_for_dp_synchronization", "eplb_config",
        "enable_eplb", "expert_placement_strategy", "num_redundant_experts", "eplb_window_size",
        "eplb_step_interval", "eplb_log_balancedness", "max_parallel_loading_workers",
        "disable_custom_all_reduce", "ray_workers_use_nsight", "worker_cls",
        "worker_extension_cls",
        # scheduler
        "max_num_batched_tokens", "max_num_partial_prefills", "max_long_partial_prefills",
        "long_prefill_token_threshold", "max_num_seqs", "num_lookahead_slots",
        "enable_chunked_prefill", "disable_chunked_mm_input", "disable_hybrid_kv_cache_manager",
        "scheduling_policy", "scheduler_cls", "external_parameters", "async_scheduling",
        # multimodal
        "limit_mm_per_prompt", "enable_mm_embeds", "interleave_mm_strings", "media_io_kwargs",
        "mm_processor_kwargs", "disable_mm_preprocessor_cache", "mm_processor_cache_gb",
        "mm_processor_cache_type", "mm_shm_cache_max_object_size_mb", "mm_encoder_tp_mode",
        "mm_encoder_attn_backend", "skip_mm_profiling", "video_pruning_rate",
        "enable_multimodal_encoder_data_parallel",
        # lora
        "enable_lora", "max_loras", "max_lora_rank", "default_mm_loras", "fully_sharded_loras",
        "max_cpu_loras", "lora_dtype", "lora_extra_vocab_size",
        # structured outputs / speculative / observability
        "structured_outputs_config", "reasoning_parser", "guided_decoding_backend",
        "guided_decoding_disable_fallback", "guided_decoding_disable_any_whitespace",
        "guided_decoding_disable_additional_properties", "speculative_config",
        "show_hidden_metrics_for_version", "otlp_traces_endpoint", "collect_detailed_traces",
        "disable_log_stats", "aggregate_engine_logging",
        # kv transfer and misc
        "kv_transfer_config", "kv_events_config", "additional_config",
        # added in vLLM <= 0.32 (EngineArgs fields of vllm 0.32.0 the list above lacked)
        "allow_deprecated_quantization", "attention_backend", "attention_config",
        "aux_output_config", "cp_kv_cache_interleave_size", "cpu_distributed_timeout_seconds",
        "cpu_offload_params", "cudagraph_metrics", "custom_histogram_buckets",
        "data_parallel_external_lb", "data_parallel_multi_port_external_lb", "dcp_comm_backend",
        "dcp_kv_cache_interleave_size", "dcp_q_replicate", "device_ids", "diffusion_config",
        "distributed_timeout_seconds", "dp_sync_interval", "ec_manager_config",
        "ec_transfer_config", "elastic_ep_max_dp_size", "enable_batch_sharded_sampling",
        "enable_cumem_allocator", "enable_elastic_ep", "enable_ep_weight_filter",
        "enable_fault_tolerance", "enable_flashinfer_autotune", "enable_hc_sp",
        "enable_layerwise_nvtx_tracing", "enable_logging_iteration_details",
        "enable_mamba_cache_stochastic_rounding", "enable_mamba_shared_prefix_checkpoint",
        "enable_mfu_metrics", "enable_mixed_moe_lora_format", "enable_mm_processor_stats",
        "enable_moe_shared_loras", "enable_nccl_comm_suspend", "enable_return_routed_experts",
        "enable_shm_tensor_arena", "enable_tower_connector_lora", "enable_trace_replay",
        "engram_config", "fail_on_environ_validation", "fault_tolerance_config",
        "gdn_prefill_backend", "ir_op_priority", "jit_monitor_mode", "jit_monitor_verbose",
        "kda_decode_backend", "kda_prefill_backend", "kernel_config", "kv_cache_dtype_skip_layers",
        "kv_cache_metrics", "kv_cache_metrics_sample", "kv_offloading_backend",
        "kv_offloading_size", "language_model_only", "linear_backend", "log_config_file",
        "log_level", "logging_config", "long_prefill_token_threshold_adaptive",
        "lora_target_modules", "mamba_backend", "mamba_cache_mode", "mamba_cache_philox_rounds",
        "mamba_config", "mamba_ssu_algorithm", "master_addr", "master_port", "max_lora_cls_labels",
        "max_num_active_seqs", "max_num_queued_reqs", "max_num_queued_tokens",
        "max_num_scheduled_tokens", "mm_device_do_normalize", "mm_encoder_attn_dtype",
        "mm_encoder_fp8_scale_path", "mm_encoder_fp8_scale_save_margin",
        "mm_encoder_fp8_scale_save_path", "mm_encoder_only", "mm_hasher_algorithm",
        "mm_ipc_gpu_memory_gb", "mm_processor_device", "mm_tensor_ipc", "model_class_overrides",
        "model_weights", "moe_backend", "nnodes", "node_rank", "numa_bind", "numa_bind_cpus",
        "numa_bind_nodes", "offload_backend", "offload_group_size", "offload_num_in_group",
        "offload_params", "offload_prefetch_step", "optimization_level",
        "per_request_spec_decode_metrics", "performance_mode", "prefill_context_parallel_size",
        "prefill_schedule_interval", "prefix_cache_retention_interval", "prefix_match_unit",
        "profiler_config", "quantization_config", "reasoning_config", "reasoning_parser_plugin",
        "renderer_num_workers", "replayssm_buffer_len", "return_sampling_mask",
        "safetensors_prefetch_block_size", "safetensors_prefetch_num_threads",
        "scheduler_reserve_full_isl", "shutdown_timeout", "sleep_mode_offload_cudagraph",
        "sleep_preserve_parameter_names", "sparse_indexer_topk_backend", "spec_method",
        "spec_model", "spec_tokens", "specialize_active_lora", "stream_interval",
        "swa_bounded_replay", "tokens_only", "ubatch_size", "use_fp64_gumbel", "use_replayssm",
        "video_pruning_method", "watermark", "watermark_config", "weight_transfer_config",
    }
)

VLLM_OMNI_ENGINE_ARG_NAMES: frozenset[str] = frozenset(
    {
        "model_stage", "model_arch", "engine_output_type", "hf_config_name", "worker_type",
        "custom_process_next_stage_input_func", "requires_full_payload_input",
        "stage_connector_spec", "silence_ban_frames", "async_chunk",
        "session_mode", "retains_state_across_chunks", "use_v2_model_runner",
        "supports_native_mrv2_data_plane", "active_stream_window", "duplex_max_sessions",
        "omni_kv_config", "quantization_config", "force_cutlass_fp8", "pooling_output_decoder",
        "task_type", "omni", "request_batch_max_wait_ms", "fa_deterministic",
        "omni_master_address", "omni_master_port", "omni_dp_size_local", "omni_lb_policy",
        "omni_heartbeat_timeout", "output_modalities", "log_stats", "custom_pipeline_args",
        "has_sampling_extra_args", "sampling_extra_args_keys",
    }
) | registry.vllm_omni_engine_args()


# Keys an hf stage reads (the rest of its engine_args mean something to vLLM / vllm-omni only).
HF_ENGINE_KEYS: frozenset[str] = frozenset({
    "engine", "model_stage", "model_arch", "hf_config_name", "engine_output_type", "model",
    "load_format", "dtype", "seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "kv_block_size", "kv_pool_blocks", "kv_lease_timeout_s", "kv_transfer_config",
    "initial_codec_chunk_frames", "codec_chunk_frames", "codec_left_context_frames",
    "attention_kernels",
    "distributed_executor_backend",  # mp: a local worker process; ray: a Ray actor
    "enable_prefix_caching",  # the autoregressive engines' prefix cache (default on)
}) | frozenset(registry.model_engine_args())  # and the keys each model's hf stages read

_WHY_UNUSED: dict[str, str] = {
    "gpu_memory_utilization": "GPU memory sizing; the hf engine's KV pool is kv_pool_blocks",
    "kv_cache_memory_bytes": "GPU memory sizing; the hf engine's KV pool is kv_pool_blocks",
    "enforce_eager": "CUDA graphs; the hf engine runs eagerly",
    "max_cudagraph_capture_size": "CUDA graphs; the hf engine runs eagerly",
    "cuda_graph_sizes": "CUDA graphs; the hf engine runs eagerly",
    "compilation_config": "torch.compile / CUDA graphs; the hf engine runs eagerly",
    "worker_type": "vllm-omni's worker kind; omni-pd runs its own engine per model_stage",
    "worker_cls": "vllm-omni's worker class; omni-pd runs its own engine per model_stage",
    "scheduler_cls": "vllm-omni's scheduler; omni-pd's engine schedules itself",
    "async_scheduling": "vllm-omni's scheduler; omni-pd's engine schedules itself",
    "trust_remote_code": "remote model code; omni-pd builds the model classes it knows",
    "enable_chunked_prefill": "not implemented by the hf engine",
    "mm_processor_cache_gb": "vLLM's multimodal processor cache",
    "custom_process_next_stage_input_func": "given to the stages this one feeds as their "
                                            "custom_process_input_func",
}


def unused_by_hf(explicit: set[str]) -> list[tuple[str, str]]:
    """The keys a stage file set (`explicit`) that an hf stage does not use, each with why."""
    return [(key, _WHY_UNUSED.get(key, "a vLLM / vllm-omni engine argument; only engine: vllm "
                                       "stages use it"))
            for key in sorted(explicit - HF_ENGINE_KEYS)]
