"""`omni-pd bench roofline CHECKPOINT_DIR`: each hf stage's step at real shapes against the
hardware's limit, measured in the same run.

For a checkpoint at Qwen3-Omni-30B-A3B's shapes (`omni-pd make-tiny-model DIR --size real
--layers N`), or Qwen2.5-Omni-7B's (`--model qwen2_5_omni`; its speech rows: roofline_qwen2_5.py), on the
device asked for, in the dtype asked for, it times the steps the engines run, through the same
runners the engines call:
  thinker_prefill  one batched prefill of `batch` prompts of `tokens` tokens
  thinker_decode   one decode step of `batch` requests with `context` tokens cached each
  talker_step      one talker step of `batch` requests: the code predictor's 15 codebooks, then
                   the talker (`context` positions cached)
  code2wav_chunk   one chunk of 25 codec frames (2 s of speech), carried state (code2wav runs
                   one chunk per step: batch does not apply)
Beside each it reports what the step must read (the weights it touches, counting only the MoE
experts its rows were routed to, plus the KV it attends to) and compute (FLOPs counted by torch's
FlopCounterMode on the same step), the host's read bandwidth and GEMM peak measured in the same
run, the roofline `max(bytes / bandwidth, flops / peak)` and `step / roofline`. Per layer figures
divide by the stack's layers. Then the speech path's real-time factor per stream (talker step +
code2wav's share per 80 ms frame) and how many streams keep up in real time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..engines.core.request import EngineRequest
from ..engines.core.runner import PrefillItem
from ..engines.hf import batch_invariant as bi
from ..engines.core.ar_engine import decode_attention, prefill_attention
from ..engines.core.paged_cache import PagedKVCache
from ..sampling import SamplingParams
from . import roofline_qwen2_5
from .report import run_metadata, write_json

STAGES = ("thinker_prefill", "thinker_decode", "talker_step", "code2wav_chunk")
SPEECH_STAGES = ("talker_step", "code2wav_chunk")
SPEECH_MODELS = ("qwen3_omni", "qwen2_5_omni")  # the models whose talker and code2wav rows it measures
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK = 16
FRAME_S = 0.08  # one codec frame: 80 ms of speech at 12.5 Hz
CHUNK_FRAMES = 25


@dataclass
class Row:
    stage: str
    batch: int
    tokens: int
    context: int
    layers: int
    step_ms: float
    bytes: int
    flops: int
    bandwidth: float  # bytes / s
    peak: float  # flop / s

    @property
    def bytes_ms(self) -> float:
        return self.bytes / self.bandwidth * 1e3

    @property
    def flops_ms(self) -> float:
        return self.flops / self.peak * 1e3

    @property
    def roofline_ms(self) -> float:
        return max(self.bytes_ms, self.flops_ms)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "step_ms_per_layer": self.step_ms / max(self.layers, 1),
            "bytes_ms": self.bytes_ms,
            "flops_ms": self.flops_ms,
            "roofline_ms": self.roofline_ms,
            "over_roofline": self.step_ms / self.roofline_ms if self.roofline_ms else None,
            "bound": "memory" if self.bytes_ms >= self.flops_ms else "compute",
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a real-shape checkpoint (`make-tiny-model --size real`)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, of " + ",".join(STAGES))
    parser.add_argument("--batches", default="1,4,16,64", help="batch sizes (default 1,4,16,64)")
    parser.add_argument("--prefill-tokens", default="512,2048", help="prompt lengths of the prefill rows")
    parser.add_argument("--prefill-batches", default="1,4", help="batches of the prefill rows (prompts)")
    parser.add_argument("--contexts", default="512,4096", help="cached tokens of the decode rows")
    parser.add_argument("--attention-kernels", default="native", choices=("native", "torch"))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 16, 512 tokens, one repeat")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    parser.add_argument("--plot", default=None, metavar="PNG")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"error: {text!r}: expected comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise SystemExit(f"error: {text!r}: expected comma-separated numbers >= 1")
    return values


# ---- the host -------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runs_s(fn: Callable[[], Any], device: torch.device, repeats: int) -> list[float]:
    """Seconds of `repeats` runs of `fn`, after one warm run (kernels built, pages touched)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - began)
    return times


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes / s that a reduction reads from a buffer far larger than the caches (the memory
    roofline a weight-streaming step runs against)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / min(_runs_s(lambda: x.sum(), device, 5))


def gemm_peak(device: torch.device, dtype: torch.dtype, n: int = 4096) -> float:
    """FLOP / s of a large square product in `dtype` (the compute roofline)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / min(_runs_s(lambda: a @ b, device, 3))


# ---- what a step touches ------------------------------------------------------------------


@dataclass
class MoeCalls:
    """What the MoE layers of the last step did: per call, the distinct experts its rows were
    routed to; and the FLOPs of the calls the C experts kernel ran (FlopCounterMode sees only
    torch's ops)."""

    experts: list[int]
    native_flops: int = 0


@contextlib.contextmanager
def moe_calls() -> Iterator[MoeCalls]:
    calls = MoeCalls([])
    original = bi.experts

    def experts(module, x, top_index, top_weights, kernels="torch"):
        calls.experts.append(int(torch.unique(top_index).numel()))
        if bi._enabled and bi.experts_form(module, kernels) == "native":
            _, double, hidden = module.gate_up_proj.shape
            # Per (row, expert): gate and up (2 x hidden x 2I), then down (2 x I x hidden).
            calls.native_flops += top_index.numel() * 3 * double * hidden
        return original(module, x, top_index, top_weights, kernels)

    bi.experts = experts
    try:
        yield calls
    finally:
        bi.experts = original


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _moe_split(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes outside the routed experts, bytes of one expert) of a decoder."""
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    expert_bytes = sum(_param_bytes(m) for m in experts)
    per_expert = (_param_bytes(experts[0]) // experts[0].gate_up_proj.shape[0]) if experts else 0
    return _param_bytes(model) - expert_bytes, per_expert


def _flops(fn: Callable[[], Any]) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Counted on torch's math attention (its products are the attention's FLOPs): the counters of
    # the fused kernels do not take every layout (a bf16 GQA decode on an H100 raised). Only the
    # count runs so; the timed runs keep the kernels torch picks.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# ---- the stages -------------------------------------------------------------------------------


class Bench:
    def __init__(self, checkpoint: str, device: str, dtype: torch.dtype, kernels: str, repeats: int):
        self.checkpoint, self.device, self.dtype = checkpoint, torch.device(device), dtype
        self.kernels = kernels if self.device.type == "cpu" and dtype == torch.float32 else "torch"
        self.repeats = repeats
        self.bandwidth = read_bandwidth(self.device)
        self.peak = gemm_peak(self.device, dtype)
        self.rows: list[Row] = []

    def _thinker_runner(self) -> tuple[Any, Callable[[], Any]]:
        """The checkpoint's model's thinker runner (registry: `roofline_thinker`), on the device."""
        from .. import registry

        spec = registry.spec_for(self.checkpoint)
        if spec.roofline_thinker is None:
            raise SystemExit(f"error: bench roofline has no thinker rows for {spec.name} checkpoints")
        return spec.roofline_thinker(self.checkpoint, self.dtype, self.device, self.kernels)

    def _load(self, stage: str):
        from ..models.qwen3_omni.factory import load_stage

        parts, _ = load_stage(self.checkpoint, stage, dtype=self.dtype)
        if self.device.type != "cpu":
            parts = parts.to(self.device)
        return parts

    def _measure(self, step: Callable[[], Any]) -> tuple[float, int, int]:
        """(median ms of `step`, the distinct experts its MoE layers read, summed over layers,
        its FLOPs), the last two from one more run, counted."""
        ms = self._time(step)
        with moe_calls() as calls, self._default_device():
            flops = _flops(step)
        return ms, sum(calls.experts), flops + calls.native_flops

    def _time(self, step: Callable[[], Any]) -> float:
        with self._default_device():
            return statistics.median(_runs_s(step, self.device, self.repeats)) * 1e3

    def _default_device(self) -> contextlib.AbstractContextManager:
        """Steps run as in a stage worker on this device: it is torch's default device there
        (engines/device.py), so the step tensors the runners make land beside the weights."""
        return self.device if self.device.type == "cuda" else contextlib.nullcontext()

    def _cache(self, layout, batch: int, positions: int) -> PagedKVCache:
        """A cache that holds `batch` sequences of `positions` each, block-aligned."""
        return PagedKVCache(layout, batch * -(-positions // BLOCK) + 1, device=str(self.device))

    def thinker(self, prefill: list[tuple[int, int]], decode: list[tuple[int, int]]) -> None:
        runner, new_state = self._thinker_runner()
        text = runner.thinker.model
        layers = len(text.layers)
        fixed, per_expert = _moe_split(text)  # a dense thinker: all of it fixed, no experts
        head = _param_bytes(runner.thinker.lm_head)
        embed = _param_bytes(text.embed_tokens)
        layout = runner.kv_layout(BLOCK)
        vocab = runner.thinker.config.text_config.vocab_size

        def requests(batch: int, length: int, cache: PagedKVCache) -> list[EngineRequest]:
            out = []
            for b in range(batch):
                ids = [(b * 7919 + i * 31) % 256 for i in range(length)]
                r = EngineRequest(
                    f"r{b}", None, SamplingParams(temperature=0), length, ids, model=new_state()
                )
                r.blocks = cache.allocate(length + 1)
                out.append(r)
            return out

        for batch, tokens in prefill:
            cache = self._cache(layout, batch, tokens + 1)
            rs = requests(batch, tokens, cache)
            for r in rs:
                r.prompt = _Prompt(r.token_ids)
            items = [PrefillItem(r, 0) for r in rs]
            ms, used, flops = self._measure(
                lambda: runner.prefill(items, prefill_attention(runner, cache, items))
            )
            touched = fixed - embed + head + used * per_expert
            nbytes = touched + batch * tokens * layout.bytes_per_token
            self._add("thinker_prefill", batch, tokens, 0, layers, ms, nbytes, flops)
        for batch, context in decode:
            cache = self._cache(layout, batch, context + 1)
            rs = requests(batch, context, cache)
            for r in rs:
                r.tokens = [int(r.token_ids[-1])]  # the position its token goes to: `context`
            ms, used, flops = self._measure(lambda: runner.decode(rs, decode_attention(runner, cache, rs)))
            touched = fixed - embed + head + used * per_expert
            nbytes = touched + batch * (context + 1) * layout.bytes_per_token + batch * embed // vocab
            self._add("thinker_decode", batch, 1, context, layers, ms, nbytes, flops)

    def talker(self, batches: list[int], context: int) -> None:
        from ..models.qwen3_omni.hf.talker_model import TalkerModel
        from ..models.qwen3_omni.hf.talker_runner import TalkerRunner, TalkerState

        parts = self._load("talker")
        talker = parts.require("talker")
        runner = TalkerRunner(
            talker,
            TalkerModel(talker, parts.require("thinker_embedding"), parts.config),
            kernels=self.kernels,
        )
        layout = runner.kv_layout(BLOCK)
        hidden = runner.config.text_config.hidden_size
        layers = len(talker.model.layers)
        fixed, per_expert = _moe_split(talker.model)
        predictor_heads = _param_bytes(talker.code_predictor.lm_head) + sum(
            e.embedding_dim * e.weight.element_size() for e in talker.code_predictor.model.codec_embedding
        )
        predictor_body = _param_bytes(talker.code_predictor.model.layers)
        groups = runner.num_code_groups - 1
        for batch in batches:
            cache = self._cache(layout, batch, context + 64)

            def fresh() -> list[EngineRequest]:
                out = []
                for b in range(batch):
                    g = torch.Generator().manual_seed(b)
                    state = TalkerState(
                        prompt_embeds=torch.zeros(context, hidden, dtype=self.dtype, device=self.device),
                        trailing=torch.randn(4096, hidden, generator=g, device="cpu")
                        .to(self.dtype)
                        .to(self.device),
                        tts_pad=torch.zeros(hidden, dtype=self.dtype, device=self.device),
                    )
                    state.hidden = (
                        torch.randn(hidden, generator=g, device="cpu").to(self.dtype).to(self.device)
                    )
                    r = EngineRequest(
                        f"t{b}",
                        None,
                        SamplingParams(temperature=0.9, top_k=50, seed=b),
                        context,
                        None,
                        model=state,
                    )
                    r.tokens = [b % 2048]
                    r.blocks = cache.allocate(context + 64)
                    out.append(r)
                return out

            rs = fresh()
            ms, used, flops = self._measure(lambda: runner.decode(rs, decode_attention(runner, cache, rs)))
            # The code predictor runs its whole stack once per codebook (`groups` times a step);
            # each codebook's head and embedding once.
            touched = (
                fixed
                - _param_bytes(talker.model.codec_embedding)
                + used * per_expert
                + _param_bytes(talker.codec_head)
                + groups * predictor_body
                + predictor_heads
            )
            nbytes = touched + batch * context * layout.bytes_per_token
            self._add("talker_step", batch, 1, context, layers, ms, nbytes, flops)
            for r in rs:
                cache.release(r.blocks)

    def code2wav(self) -> None:
        from ..models.qwen3_omni.hf.code2wav_runner import Code2WavRunner

        parts = self._load("code2wav")
        module = parts.require("code2wav")
        quantizers = parts.config.code2wav_config.num_quantizers
        codebook = parts.config.code2wav_config.codebook_size  # the real model's 2048
        codes = torch.randint(
            0,
            codebook,
            (quantizers, 4 * CHUNK_FRAMES),
            generator=torch.Generator().manual_seed(0),
            device="cpu",
        ).to(self.device)
        torch_runner = Code2WavRunner(module, quantizers, "torch")
        with self._default_device():
            flops = _flops(
                lambda: torch_runner.decode_chunk(torch_runner.new_stream(), codes[:, :CHUNK_FRAMES], None)
            )
        # Both of code2wav's kernel sets where both run (the C kernels: float32 on the CPU).
        native = self.device.type == "cpu" and self.dtype == torch.float32
        for kernels in ("native", "torch") if native else ("torch",):
            runner = Code2WavRunner(module, quantizers, kernels)
            with self._default_device():
                state = runner.new_stream()
                runner.decode_chunk(state, codes[:, :CHUNK_FRAMES], None)  # later chunks carry state
            ms = self._time(
                lambda: runner.decode_chunk(state, codes[:, CHUNK_FRAMES : 2 * CHUNK_FRAMES], None)
            )
            self._add(
                f"code2wav_chunk[{kernels}]",
                1,
                CHUNK_FRAMES,
                0,
                parts.config.code2wav_config.num_hidden_layers,
                ms,
                _param_bytes(module),
                flops,
            )

    def _add(self, stage, batch, tokens, context, layers, ms, nbytes, flops) -> None:
        row = Row(
            stage, batch, tokens, context, layers, ms, int(nbytes), int(flops), self.bandwidth, self.peak
        )
        self.rows.append(row)
        d = row.as_dict()
        print(
            f"{stage:22s} batch {batch:3d} tokens {tokens:5d} context {context:5d}: "
            f"{ms:9.2f} ms ({d['step_ms_per_layer']:7.2f} / layer), roofline {row.roofline_ms:8.2f} ms "
            f"({d['bound']}), x{d['over_roofline']:.2f}",
            flush=True,
        )


@dataclass
class _Prompt:
    prompt_token_ids: list[int]


def real_time(rows: list[Row], frame_s: float = FRAME_S) -> dict[str, Any]:
    """The speech path per stream: talker step + code2wav's share of a chunk (of `tokens`
    frames) per frame of `frame_s` seconds of speech (Qwen3-Omni's: 80 ms)."""
    chunks = [r for r in rows if r.stage.startswith("code2wav_chunk")]
    chunk = min(chunks, key=lambda r: r.step_ms) if chunks else None  # the faster kernels
    talker = [r for r in rows if r.stage == "talker_step"]
    if chunk is None or not talker:
        return {}
    per_frame_c2w = chunk.step_ms / chunk.tokens
    out: dict[str, Any] = {"code2wav_ms_per_frame": per_frame_c2w, "by_batch": []}
    for r in talker:
        # One talker step makes a frame for each of `batch` streams; code2wav decodes each.
        frame_ms = r.step_ms + r.batch * per_frame_c2w
        out["by_batch"].append(
            {
                "batch": r.batch,
                "ms_per_frame": frame_ms,
                "rtf": frame_ms / (frame_s * 1e3),
                "real_time": frame_ms <= frame_s * 1e3,
            }
        )
    keeping = [b["batch"] for b in out["by_batch"] if b["real_time"]]
    out["streams_in_real_time"] = max(keeping) if keeping else 0
    return out


def run(args: argparse.Namespace) -> int:
    if not Path(args.checkpoint).is_dir():
        print(
            f"error: {args.checkpoint} is not a checkpoint directory (write one with "
            "`omni-pd make-tiny-model DIR --size real --layers N`)",
            file=sys.stderr,
        )
        return 2
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"error: unknown stage(s) {unknown}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    from .. import registry

    model = registry.spec_for(args.checkpoint).name
    speech = [s for s in stages if s in SPEECH_STAGES]
    if speech and model not in SPEECH_MODELS:
        # The talker's and code2wav's rows are written around each model's runners.
        print(
            f"{', '.join(speech)}: measured on {', '.join(SPEECH_MODELS)} checkpoints only; this is a "
            f"{model} checkpoint, so its rows are the thinker's",
            file=sys.stderr,
        )
        stages = [s for s in stages if s not in SPEECH_STAGES]
        if not stages:
            return 2
    batches = [1, 16] if args.quick else _ints(args.batches)
    tokens = [512] if args.quick else _ints(args.prefill_tokens)
    prefill_batches = [1] if args.quick else _ints(args.prefill_batches)
    contexts = [512] if args.quick else _ints(args.contexts)
    repeats = 1 if args.quick else args.repeats
    bench = Bench(args.checkpoint, args.device, DTYPES[args.dtype], args.attention_kernels, repeats)
    print(
        f"host: read bandwidth {bench.bandwidth / 2**30:.1f} GiB/s, {args.dtype} GEMM peak "
        f"{bench.peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)",
        flush=True,
    )
    with torch.no_grad():
        if "thinker_prefill" in stages or "thinker_decode" in stages:
            bench.thinker(
                [(b, t) for t in tokens for b in prefill_batches] if "thinker_prefill" in stages else [],
                [(b, c) for c in contexts for b in batches] if "thinker_decode" in stages else [],
            )
        if model == "qwen2_5_omni":
            if "talker_step" in stages:
                roofline_qwen2_5.talker(bench, batches, 256, BLOCK)
            if "code2wav_chunk" in stages:
                roofline_qwen2_5.token2wav(bench)
        else:
            if "talker_step" in stages:
                bench.talker(batches, 256)
            if "code2wav_chunk" in stages:
                bench.code2wav()
    rt = real_time(bench.rows, roofline_qwen2_5.CODE_S if model == "qwen2_5_omni" else FRAME_S)
    if rt:
        print(
            f"speech: code2wav {rt['code2wav_ms_per_frame']:.2f} ms per frame; streams in real time: "
            f"{rt['streams_in_real_time']}"
        )
    if args.json_path:
        meta = run_metadata(
            sys.argv,
            device=args.device,
            dtype=args.dtype,
            bandwidth=bench.bandwidth,
            gemm_peak=bench.peak,
            threads=torch.get_num_threads(),
        )
        write_json(args.json_path, {**meta, "real_time": rt}, [r.as_dict() for r in bench.rows])
    if args.plot:
        _plot(bench.rows, args.plot)
    return 0


def _plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r.stage}\nb{r.batch} t{r.tokens} c{r.context}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r.step_ms for r in rows], 0.4, label="step")
    ax.bar([i + 0.2 for i in x], [r.roofline_ms for r in rows], 0.4, label="roofline")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
