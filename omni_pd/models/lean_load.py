"""One part of a model, loaded lean from a sharded checkpoint: built on the `meta` device from its
sub-config (no memory, no initialisation), then filled with its tensors only (`checkpoint.read_plan`
opens only the shards that hold them).

As transformers' `from_pretrained` does: tied weights the checkpoint leaves out are tied after
loading, and non-persistent buffers (rotary `inv_freq`, position tables, filters computed from
the config) are recomputed by the model's own weight init, which skips every tensor that was
loaded. A model package says which class and sub-config each of its stages builds, under which
checkpoint prefix, and how to read a tensor the checkpoint stores another way (Qwen3-Omni's
per-expert MoE weights: `expand`).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from .checkpoint import CheckpointError, LoadReport, Piece, ShardIndex, TensorPlan, read_plan

log = logging.getLogger(__name__)

# (checkpoint name, the module's state-dict key, its shape) -> the pieces that fill it, for a
# name the checkpoint does not hold as one tensor; None: the name as it is.
Expand = Callable[[str, str, torch.Size], "list[Piece] | None"]


def empty_module(cls, config, dtype: torch.dtype) -> torch.nn.Module:
    """`cls` (a transformers model class) built from `config` on the meta device."""
    with torch.device("meta"):
        return cls._from_config(config, dtype=dtype)


def module_plan(
    module: torch.nn.Module, prefix: str, index: ShardIndex, expand: Expand | None = None
) -> tuple[TensorPlan, set[str]]:
    """The checkpoint tensors filling `module` (named `prefix` + its state_dict keys), and the
    tied keys the checkpoint leaves out (tied after loading, as transformers does)."""
    plan, tied_absent = TensorPlan(), set()
    tied = getattr(module, "all_tied_weights_keys", None) or {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        name = prefix + key
        if key in tied and name not in index.weight_map:
            tied_absent.add(key)
            continue
        pieces = (
            expand(name, key, tensor.shape) if expand is not None and name not in index.weight_map else None
        )
        plan.add(key, tensor.shape, tensor.dtype, pieces or [Piece(name)])
    return plan, tied_absent


def load_module(
    index: ShardIndex, module: torch.nn.Module, prefix: str, what: str, expand: Expand | None = None
) -> tuple[torch.nn.Module, LoadReport]:
    """`module` (built by `empty_module`) filled from the checkpoint tensors under `prefix`."""
    plan, tied_absent = module_plan(module, prefix, index, expand)
    tensors, report = read_plan(index, plan, what)
    module.load_state_dict(tensors, strict=False, assign=True)
    for tensor in module.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True  # the weight init below must leave loaded tensors alone
    if tied_absent:
        module.tie_weights(missing_keys=tied_absent, recompute_mapping=False)
    _materialise_buffers(module)
    left = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(
            f"{index.source}: the {what} part has no values for {left[:5]}; the checkpoint does "
            "not match its config.json"
        )
    return module.eval(), report


@torch.no_grad()
def _materialise_buffers(module: torch.nn.Module) -> None:
    """Non-persistent buffers are not in checkpoints: allocate them and let the model's weight
    init compute them (the only tensors it touches: every loaded one is marked initialised)."""
    for owner in module.modules():
        for name, buffer in list(owner._buffers.items()):
            if buffer is not None and buffer.is_meta:
                owner._buffers[name] = torch.empty_like(buffer, device="cpu")
    module.initialize_weights()


def load_embedding(
    index: ShardIndex, name: str, rows: int, width: int, dtype: torch.dtype, what: str
) -> tuple[torch.nn.Embedding, LoadReport]:
    """One embedding table from the checkpoint tensor `name` (a talker's view of the thinker's
    token embedding, say)."""
    with torch.device("meta"):
        embedding = torch.nn.Embedding(rows, width, dtype=dtype)
    plan = TensorPlan()
    plan.add("weight", embedding.weight.shape, dtype, [Piece(name)])
    tensors, report = read_plan(index, plan, what)
    embedding.load_state_dict(tensors, assign=True)
    return embedding.eval(), report


def log_reports(stage_id: int, reports: Sequence[LoadReport]) -> None:
    """What a stage read, one INFO line per part (a deployer sees a lean load stay lean)."""
    for r in reports:
        log.info(
            "stage %d: loaded %s part, %d tensors, %.1f MiB from %d of %d shards in %.2f s",
            stage_id,
            r.part,
            r.tensors,
            r.bytes / 2**20,
            len(r.shards_read),
            r.shards_total,
            r.seconds,
        )
