"""One stage's replicas as stage configs of their own.

Each replica is a worker like any other stage's, so it gets a config that differs only where two
workers of one stage would collide: its share of `runtime.devices`, its own set of `runtime.cpus`
(the k-th; the checks made sure there is one per replica), its KV `engine_id`, and a
fixed Mooncake bootstrap port (replica k listens on the file's port + k). The engines never
learn that they are replicas.
"""

from __future__ import annotations

from .schema import StageConfig


def replica_configs(stage: StageConfig) -> list[StageConfig]:
    count = stage.runtime.num_replicas
    if count == 1:
        return [stage]
    return [_replica(stage, k) for k in range(count)]


def _replica(stage: StageConfig, k: int) -> StageConfig:
    runtime = stage.runtime
    if runtime.devices:
        tp = stage.engine_args.tensor_parallel_size
        devices = [d.strip() for d in runtime.devices.split(",") if d.strip()]
        runtime = runtime.model_copy(update={"devices": ",".join(devices[k * tp : (k + 1) * tp])})
    if runtime.cpus:
        runtime = runtime.model_copy(update={"cpus": (runtime.cpus[k],)})
    args = stage.engine_args
    kv = args.kv_transfer_config
    if kv is not None:
        update: dict = {}
        if kv.engine_id:
            update["engine_id"] = f"{kv.engine_id}-r{k}"
        if kv.kv_port is not None:
            update["kv_port"] = kv.kv_port + k
        extra = kv.kv_connector_extra_config
        if extra.mooncake_bootstrap_port is not None:
            update["kv_connector_extra_config"] = extra.model_copy(
                update={"mooncake_bootstrap_port": extra.mooncake_bootstrap_port + k}
            )
        if update:
            args = args.model_copy(update={"kv_transfer_config": kv.model_copy(update=update)})
    return stage.model_copy(update={"runtime": runtime, "engine_args": args})
