"""The `omni-pd` command: generate, serve, bench, validate-config, make-tiny-model, vllm-shim."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from ..models.qwen3_omni.tiny_config import TINY_MODEL_NAME
from .openai.protocol import DEFAULT_MAX_REQUEST_BYTES

if TYPE_CHECKING:
    from ..orchestrator.omni import Omni
    from ..orchestrator.outputs import OmniRequestOutput

log = logging.getLogger("omni_pd.cli")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=TINY_MODEL_NAME,
        help=f"checkpoint directory or the embedded {TINY_MODEL_NAME!r} (default)",
    )
    configs = parser.add_mutually_exclusive_group()
    configs.add_argument(
        "--stage-configs-path",
        default=None,
        help="stage YAML: vllm-omni's stage_args file or a 0.30 deploy file, told "
        "by its keys (default: stage_configs/ci/qwen3_omni_tiny_pd.yaml, P/D on "
        "the CPU)",
    )
    configs.add_argument(
        "--deploy-config",
        default=None,
        metavar="PATH",
        help="a vllm-omni 0.30 deploy YAML (`stages` overrides of the built-in "
        "Qwen3-Omni pipeline), e.g. stage_configs/deploy/qwen3_omni_tiny_pd.yaml",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu"),
        default="auto",
        help="auto: an hf stage runs on the GPU its runtime.devices names (refused "
        "at start where torch sees no such GPU, and for tensor parallelism); cpu: "
        "every hf stage on the CPU anyway",
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from ..audio_io import write_wav
    from ..audio_io import decode_audio
    from ..orchestrator.omni import Omni

    content: object = args.prompt
    if args.audio:
        with open(args.audio, "rb") as handle:
            audio = decode_audio(handle.read())
        content = [{"type": "text", "text": args.prompt}, {"type": "audio", "audio": audio}]
    prompt = {"messages": [{"role": "user", "content": content}], "speaker": args.voice}
    with Omni(
        model=args.model,
        stage_configs_path=args.stage_configs_path,
        deploy_config=args.deploy_config,
        device=args.device,
    ) as omni:
        if args.stream:
            result = _generate_streaming(omni, prompt, args.output, print_text=not args.json)
        else:
            result = omni.generate([prompt], use_tqdm=False)[0]
    audio_path = None
    if result.audio is not None:
        audio_path = str(
            args.output if args.stream else write_wav(args.output, result.audio, result.sample_rate)
        )
    if args.timeline:
        from ..bench.timeline import plot_timeline
        from ..paths import default_stage_config

        config = Path(args.deploy_config or args.stage_configs_path or default_stage_config()).name
        plot_timeline(result.metrics, args.timeline, title=f"one request, {config}")
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": result.request_id,
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "prompt_token_ids": result.prompt_token_ids,
                    "finish_reason": result.finish_reason,
                    "audio_path": audio_path,
                    "sample_rate": result.sample_rate,
                    "num_samples": 0 if result.audio is None else int(result.audio.numel()),
                    "audio_sha256": result.audio_sha256,
                    "metrics": result.metrics,
                }
            )
        )
    else:
        m = result.metrics
        if not args.stream:  # streamed, the text is printed already
            print(f"text: {result.text!r}")
        print(
            f"tokens: {len(result.token_ids)} generated from a {len(result.prompt_token_ids)}-token "
            f"prompt ({result.finish_reason})"
        )
        if audio_path:
            print(f"audio: {audio_path} ({result.audio.numel()} samples at {result.sample_rate} Hz)")
        stages = ", ".join(f"stage {k} {v:.1f} ms" for k, v in m["stage_ms"].items())
        first_audio = f", first audio {m['ttfa_ms']:.1f} ms" if m.get("ttfa_ms") is not None else ""
        print(f"timings: ttft {m['ttft_ms']:.1f} ms{first_audio}, end-to-end {m['e2e_ms']:.1f} ms ({stages})")
        if "kv_bytes_transferred" in m:
            print(
                f"kv handoff: {m['kv_bytes_transferred']} bytes for {m['num_cached_prompt_tokens']} "
                f"prompt tokens in {m['kv_transfer_ms']:.2f} ms ({m.get('kv_path', 'tcp')})"
            )
    return 0


def _printable(text: str) -> str:
    # Random weights produce random bytes: escape what would drive the terminal.
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def _generate_streaming(omni: Omni, prompt: Any, output: str, print_text: bool) -> OmniRequestOutput:
    """Run `prompt` with `Omni.stream`: print text as it arrives and append each piece of audio
    to the WAV at `output` (flushed, so the file grows while the request runs)."""
    from ..audio_io import open_wav
    from ..orchestrator.async_omni import AudioDelta, Finished, TextDelta

    wav = None
    if print_text:
        print("text: ", end="", flush=True)
    try:
        with contextlib.closing(omni.stream(prompt)) as events:
            for event in events:
                if isinstance(event, TextDelta) and print_text:
                    print(_printable(event.text), end="", flush=True)
                elif isinstance(event, AudioDelta):
                    if wav is None:
                        wav = open_wav(output, event.sample_rate)
                    wav.write(event.audio.float().numpy())
                    wav.flush()
                elif isinstance(event, Finished):
                    if print_text:
                        print()
                    return event.output
    finally:
        if wav is not None:
            wav.close()
    raise RuntimeError("the stream ended without its output")


def _cmd_validate(args: argparse.Namespace) -> int:
    from .validate import run_validate

    if (args.path is None) == (args.deploy_config is None):
        print(
            "error: give one stage YAML: PATH (either schema, told by its keys) or --deploy-config PATH",
            file=sys.stderr,
        )
        return 2
    if args.deploy_config is not None:
        return run_validate(args.deploy_config, deploy=True, platform=args.platform)
    return run_validate(args.path, platform=args.platform)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from ..models.qwen3_omni.factory import save_tiny_model

    if args.size == "real":
        return _make_real_model(args)
    if args.model != "qwen3_omni":
        return _make_other_tiny_model(args)
    if args.layers is not None:
        print("error: --layers cuts the real-shape model's stacks; use it with --size real", file=sys.stderr)
        return 2
    out = save_tiny_model(args.directory, seed=args.seed, size=args.size, max_shard_size=args.max_shard_size)
    layout = f"shards of at most {args.max_shard_size}" if args.max_shard_size else "one file"
    print(
        f"wrote the {args.size} Qwen3-Omni checkpoint (config, tokenizer, safetensors in {layout}) to {out}"
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..orchestrator.async_omni import AsyncOmni
    from .openai.api_server import create_app

    model = args.model_tag or args.model
    served = args.served_model_name or model
    holder: dict = {}

    def fail_startup() -> None:
        holder["failed"] = True
        holder["server"].should_exit = True

    app = create_app(
        lambda: AsyncOmni(
            model,
            args.stage_configs_path,
            deploy_config=args.deploy_config,
            request_timeout_s=args.request_timeout,
            device=args.device,
        ),
        served,
        enable_debug_endpoints=args.enable_debug_endpoints,
        on_startup_failure=fail_startup,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes or None,
        max_queued_requests=args.max_queued_requests,
        demo_page=not args.no_demo_page,
        stream_audio_form=args.stream_audio_form,
        trace_hops=args.trace_hops,
        default_modalities=tuple(args.default_modalities.split(",")),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=30,
        )
    )
    holder["server"] = server
    server.run()
    return 1 if holder.get("failed") else 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from ..bench.serve import run

    return run(args)


def _cmd_bench_handoff(args: argparse.Namespace) -> int:
    from ..bench.handoff import run

    return run(args)


def _cmd_bench_roofline(args: argparse.Namespace) -> int:
    from ..bench.roofline import run

    return run(args)


def _cmd_bench_load(args: argparse.Namespace) -> int:
    from ..bench.checkpoint_load import run

    return run(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..plan.cli import run

    return run(args)


def _cmd_vllm_shim(args: argparse.Namespace) -> int:
    from . import vllm_omni_shim as shim

    try:
        if args.action == "install":
            where = shim.install(args.target)
            print(
                f"installed omni-pd's vllm_omni shim at {where}: `vllm serve MODEL --omni "
                "--stage-configs-path PATH` (or `--deploy-config PATH`) now runs omni-pd's "
                "server"
            )
        elif args.action == "uninstall":
            where = shim.uninstall(args.target)
            print(f"removed {where}" if where else "omni-pd's vllm_omni shim was not installed")
        else:
            print(shim.status(args.target))
    except shim.ShimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _byte_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give a byte count, or 0 for no limit")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-pd", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run one prompt through every stage")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the user's message")
    gen.add_argument("--audio", default=None, help="an audio file to send with the prompt")
    gen.add_argument("--voice", default="ethan", help="the talker's speaker")
    gen.add_argument("--output", default="out.wav", help="where to write the WAV (float32)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the results")
    gen.add_argument(
        "--timeline",
        default=None,
        metavar="PNG",
        help="draw the request's timeline (stage spans, audio chunks) into this PNG",
    )
    gen.add_argument(
        "--stream",
        action="store_true",
        help="print the text as it comes and write the WAV as its audio comes",
    )
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (text and speech)")
    serve.add_argument("model_tag", nargs="?", default=None, help="same as --model")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the model argument)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds a request may take before it fails with 504",
    )
    serve.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="expose GET /debug/state (per-request state counts, worker pids)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("OMNI_PD_API_KEY"),
        help="require `Authorization: Bearer KEY` on every /v1/* endpoint (401 "
        "without it); /health and /metrics stay open (default: $OMNI_PD_API_KEY, "
        "else no key)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=_byte_count,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="refuse request bodies larger than this with 413, before reading "
        f"them (default: {DEFAULT_MAX_REQUEST_BYTES} = "
        f"{DEFAULT_MAX_REQUEST_BYTES // 2**20} MiB; 0: no limit)",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests that may wait while the stages serve as many as they admit "
        "(the smallest max_num_seqs x num_replicas of the stages); past them a "
        "request gets a 429 at once, with Retry-After (default: 4 x that capacity; 0: none wait)",
    )
    serve.add_argument(
        "--stream-audio-form",
        choices=("openai", "vllm-omni"),
        default="openai",
        help="how a streamed chat completion sends audio: openai (delta.audio with base64 "
        "pcm16 and its transcript; OpenAI's SDK reads it) or vllm-omni (delta.content with a "
        "base64 16-bit WAV per chunk and the choice's audio_metadata, as vllm-omni's server "
        "sends it; its benchmark client reads it). Every chunk carries vllm-omni's top-level "
        "`modality` either way (default: openai)",
    )
    serve.add_argument(
        "--default-modalities",
        choices=("text", "text,audio"),
        default="text",
        help="what a chat request that names no `modalities` is answered with: text, as OpenAI "
        "answers, or text,audio, as vllm-omni's server answers (its clients, such as its "
        "benchmark client, send no `modalities`) (default: text)",
    )
    serve.add_argument(
        "--trace-hops",
        action="store_true",
        help="each chat answer carries its request's timeline as a top-level omni_pd_timeline "
        "(in a stream: on the chunk with the finish reason): when it passed the API server, the "
        "orchestrator, each stage worker and the KV transfer, in ms since the server took it "
        "(one host's CLOCK_MONOTONIC; scripts/hop_timeline.py prints it)",
    )
    serve.add_argument(
        "--no-demo-page",
        action="store_true",
        help="do not serve the voice demo page (default: served at /demo/, and / redirects to it)",
    )
    serve.set_defaults(func=_cmd_serve)

    from ..bench.serve import add_arguments as add_bench_serve_arguments

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser(
        "serve",
        help="load-test `omni-pd serve` (one server per stage "
        "config) at several concurrency levels; table, JSON, PNG",
    )
    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=_cmd_bench_serve)
    from ..bench.checkpoint_load import add_arguments as add_bench_load_arguments

    bench_load = bench_sub.add_parser(
        "load",
        help="load a checkpoint the way each hf stage does, "
        "each in a fresh process: bytes, peak RSS growth, time, "
        "read throughput against `cat`",
    )
    add_bench_load_arguments(bench_load)
    bench_load.set_defaults(func=_cmd_bench_load)
    from ..bench.handoff import add_arguments as add_bench_handoff_arguments

    bench_handoff = bench_sub.add_parser(
        "handoff",
        help="time the P/D KV handoff against one raw Mooncake read and an in-process copy of the same bytes",
    )
    add_bench_handoff_arguments(bench_handoff)
    bench_handoff.set_defaults(func=_cmd_bench_handoff)
    from ..bench.roofline import add_arguments as add_bench_roofline_arguments

    bench_roofline = bench_sub.add_parser(
        "roofline",
        help="each stage's step at real shapes against the memory and compute roofline measured in the same run",
    )
    add_bench_roofline_arguments(bench_roofline)
    bench_roofline.set_defaults(func=_cmd_bench_roofline)

    from ..plan.cli import add_arguments as add_plan_arguments

    plan = sub.add_parser(
        "plan",
        help="predict each layout's goodput (P/D, colocated replicas) from measured step costs, "
        "a workload and SLOs, and recommend one",
    )
    add_plan_arguments(plan)
    plan.set_defaults(func=_cmd_plan)

    shim = sub.add_parser(
        "vllm-shim",
        help="make `vllm serve MODEL --omni` run omni-pd's server where vllm-omni is not installed (opt-in)",
    )
    shim.add_argument("action", choices=["install", "uninstall", "status"])
    shim.add_argument(
        "--target", default=None, help="directory on sys.path to write to (default: this env's site-packages)"
    )
    shim.set_defaults(func=_cmd_vllm_shim)

    val = sub.add_parser("validate-config", help="check a stage YAML and print its summary")
    val.add_argument(
        "path",
        nargs="?",
        default=None,
        help="a stage_args file or a vllm-omni 0.30 deploy file (told by its keys)",
    )
    val.add_argument("--deploy-config", default=None, metavar="PATH", help="a vllm-omni 0.30 deploy file")
    from ..config.deploy_yaml import PLATFORMS

    val.add_argument(
        "--platform",
        default=None,
        choices=PLATFORMS,
        help="whose `platforms:` section of a deploy file applies (default: this "
        "machine's: cuda, rocm or xpu where torch sees one, else cpu)",
    )
    val.set_defaults(func=_cmd_validate)

    tiny = sub.add_parser(
        "make-tiny-model", help="write the embedded tiny model (or a larger random one) as a checkpoint"
    )
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--model",
        default="qwen3_omni",
        metavar="NAME",
        help="which model's tiny checkpoint: qwen3_omni (default) or qwen2_5_omni",
    )
    tiny.add_argument(
        "--size",
        choices=("tiny", "medium", "real"),
        default="tiny",
        help="tiny: the embedded model (default); medium (qwen3_omni): 1.1 GB of float32 with "
        "parts sized like the real model's (thinker > talker > code2wav); real: every dimension of "
        "the published model (Qwen3-Omni-30B-A3B-Instruct, Qwen2.5-Omni-7B) in bf16, each "
        "transformer stack cut to --layers",
    )
    tiny.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="with --size real: layers per transformer stack (1 to the model's deepest: 48 for "
        "qwen3_omni, 32 for qwen2_5_omni; a stack with fewer keeps them all)",
    )
    tiny.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="write HF's sharded layout with shards of at most SIZE (e.g. 200MB) "
        "and model.safetensors.index.json (default: one model.safetensors)",
    )
    tiny.set_defaults(func=_cmd_make_tiny_model)
    return parser


def _registered_writer(model: str, attribute: str, what: str, also: str = "") -> Callable[..., Any] | None:
    """The registered model's checkpoint writer (its spec's `attribute`), or None after saying
    which models have one."""
    from .. import registry

    specs = registry.specs()
    writer = getattr(specs[model], attribute) if model in specs else None
    if writer is None:
        writers = sorted(name for name, spec in specs.items() if getattr(spec, attribute))
        print(
            f"error: --model {model!r} has no {what} checkpoint to write; choose {also}one of {writers}",
            file=sys.stderr,
        )
    return writer


def _make_other_tiny_model(args: argparse.Namespace) -> int:
    """Another registered model's embedded tiny checkpoint (its package writes it)."""
    write = _registered_writer(args.model, "write_tiny_checkpoint", "tiny", also="qwen3_omni or ")
    if write is None:
        return 2
    if args.size != "tiny" or args.layers is not None or args.max_shard_size is not None:
        print(
            "error: --size medium, --layers and --max-shard-size write Qwen3-Omni's medium model "
            f"or a real-shape one (--size real); --model {args.model} writes its tiny model here "
            "(drop them, or ask for --size real --layers N)",
            file=sys.stderr,
        )
        return 2
    out = write(args.directory, args.seed)
    print(f"wrote the tiny {args.model} checkpoint (config, tokenizer, safetensors and voices) to {out}")
    return 0


def _make_real_model(args: argparse.Namespace) -> int:
    """A random checkpoint at a registered model's published shapes, its stacks cut to --layers
    (the model's package writes it)."""
    write = _registered_writer(args.model, "write_real_checkpoint", "real-shape")
    if write is None:
        return 2
    if args.layers is None:
        print(
            "error: --size real needs --layers N (each transformer stack is cut to N layers)", file=sys.stderr
        )
        return 2
    try:
        shard = _parse_size(args.max_shard_size) if args.max_shard_size else 4 * 2**30
        write(args.directory, args.layers, args.seed, shard)
    except (ValueError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _parse_size(text: str) -> int:
    """'200MB', '4GB', '4GiB' or a byte count -> bytes (as save_pretrained reads max_shard_size)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for suffix, factor in units.items():
        if upper.endswith(suffix) and upper[: -len(suffix)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(suffix)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise ValueError(f"--max-shard-size {text!r}: use a size such as 200MB, 4GB or 4GiB")


def run_vllm_command(argv: list[str] | None = None) -> None:
    """What `vllm ... --omni` runs once the shim is installed; exits with the server's status
    (given `argv`, as a caller in a process of its own: SystemExit, not the process's end)."""
    from . import vllm_omni_shim as shim

    try:
        omni_pd_argv = shim.translate_vllm_argv(list(sys.argv[1:] if argv is None else argv))
    except shim.ShimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"vllm --omni: handing over to omni-pd ({' '.join(omni_pd_argv)})", file=sys.stderr)
    code = main(omni_pd_argv)
    if argv is not None:
        sys.exit(code)
    exit_process(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except Exception as exc:
        # Imported here: most commands never load torch. A stage that cannot start (a broken
        # checkpoint, an unknown model, ...) says why in one line; the orchestrator's stack adds
        # nothing to it.
        from ..models.checkpoint import CheckpointError
        from ..orchestrator.stage_client import StageError
        from ..registry import ModelNotFound

        if not isinstance(exc, (StageError, CheckpointError, ModelNotFound)):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1


def entry() -> NoReturn:
    """The `omni-pd` console script (and `python -m omni_pd.entrypoints.cli`): main's status."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    """Exit with `code` once the process's other threads have ended and everything it
    registered for its exit has run (workers stopped, temporary files removed, log handlers
    flushed), without the interpreter's teardown: after a pipeline ran, freeing torch's,
    transformers' and the models' ~450k objects one by one takes 1-2.5 s on 2 cores, for
    nothing the operating system does not do at once. Only where this process is the command;
    `main` itself returns, for callers in a process of their own."""
    for thread in threading.enumerate():  # as the interpreter's exit would: joined first
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(int(code or 0))


if __name__ == "__main__":
    entry()
