"""code2wav decoded in chunks equals the whole-utterance decode bit for bit, and the receptive
field derived from the config is what makes it so; with the decoder on omni-pd's C kernels
(native, the default) and on torch ops alike."""

import ctypes

import pytest
import torch

from omni_pd.engines.core.chunked import ChunkedEngine
from omni_pd.models.qwen3_omni.hf.code2wav_runner import Code2WavRunner
from omni_pd.models.qwen3_omni.hf.code2wav_exact import (
    Code2WavStream,
    ExactCode2Wav,
    column_product,
    tiled_linear,
)
from omni_pd.engines.types import AudioOutput
from omni_pd.models.qwen3_omni.records import Code2WavPrompt
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.exactness


@pytest.fixture(scope="module", params=["native", "torch"])
def exact(tiny_model, request):
    return ExactCode2Wav(tiny_model.code2wav, request.param)


def _codes(tiny_model, frames: int, seed: int) -> torch.Tensor:
    cfg = tiny_model.config.code2wav_config
    return torch.randint(
        0, cfg.codebook_size, (cfg.num_quantizers, frames), generator=torch.Generator().manual_seed(seed)
    )


def _chunked(
    exact, codes, first: int, size: int, left_context: int | None, forget_at: int | None = None
) -> torch.Tensor:
    """Decode in chunks (left_context None: carried state); `forget_at`: drop the decoder's
    carried state before the chunk starting at that frame (a negative control)."""
    stream, pieces, start = Code2WavStream(), [], 0
    while start < codes.shape[1]:
        end = min(start + (first if start == 0 else size), codes.shape[1])
        if start == forget_at:
            stream.carry = {}
        pieces.append(exact.decode_chunk(stream, codes[:, start:end], left_context))
        start = end
    return torch.cat(pieces)


def test_geometry_bounds_what_a_frame_really_reaches(tiny_model, exact):
    """Perturb one frame: the samples that change start where the geometry says that frame's
    samples start, and end within the derived receptive field."""
    geo = exact.geometry
    codes = _codes(tiny_model, 140, 0)
    frame = 40
    changed = codes.clone()
    changed[:, frame] = (changed[:, frame] + 1) % tiny_model.config.code2wav_config.codebook_size
    with torch.no_grad():
        base = tiny_model.code2wav(codes.unsqueeze(0)).reshape(-1)
        moved = (tiny_model.code2wav(changed.unsqueeze(0)).reshape(-1) - base).abs() > 0
    assert base.numel() == geo.samples(140)
    hit = moved.nonzero().reshape(-1)
    assert int(hit[0]) == frame * geo.samples_per_frame - geo.trim  # causal, shifted by the trim
    last_frame_reached = (int(hit[-1]) + geo.trim) // geo.samples_per_frame
    assert frame + geo.attention_frames < last_frame_reached <= frame + geo.receptive_field_frames


@pytest.mark.parametrize("frames", [50, 140])  # 140: past the pre-transformer's 72-frame window
def test_exact_decode_is_transformers_code2wav_to_the_last_bits(tiny_model, exact, frames):
    codes = _codes(tiny_model, frames, 1)
    with torch.no_grad():
        ref = tiny_model.code2wav(codes.unsqueeze(0)).reshape(-1)
    ours = exact.decode(codes)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("first,size", [(4, 25), (1, 1), (2, 3), (7, 50), (120, 120)])
def test_chunks_with_the_derived_left_context_equal_the_whole_decode(tiny_model, exact, first, size):
    codes = _codes(tiny_model, 120, 2)
    whole = exact.decode(codes)
    assert torch.equal(_chunked(exact, codes, first, size, exact.geometry.decoder_frames), whole)


@pytest.mark.parametrize("first,size", [(4, 25), (1, 1), (2, 3), (7, 50), (120, 120)])
def test_chunks_with_carried_state_equal_the_whole_decode(tiny_model, exact, first, size):
    codes = _codes(tiny_model, 120, 2)
    assert torch.equal(_chunked(exact, codes, first, size, None), exact.decode(codes))


def test_chunks_that_lose_the_carried_state_are_detected(tiny_model, exact):
    codes = _codes(tiny_model, 120, 2)
    dropped = _chunked(exact, codes, 4, 25, None, forget_at=29)
    assert dropped.numel() > 0 and not torch.equal(dropped, exact.decode(codes))


def test_chunks_that_lose_the_carried_keys_and_values_are_detected(tiny_model, exact):
    """Negative control for the pre-transformer's carried window: a chunk that starts from an
    empty window (as if the utterance began there) misses the whole decode."""
    codes = _codes(tiny_model, 60, 2)
    stream = Code2WavStream()
    first = exact.decode_chunk(stream, codes[:, :30])
    stream.past = None
    second = exact.decode_chunk(stream, codes[:, 30:])
    whole = exact.decode(codes)
    assert torch.equal(first, whole[: first.numel()])
    assert not torch.equal(second, whole[first.numel() :])


def test_too_little_left_context_is_detected(tiny_model, exact):
    codes = _codes(tiny_model, 120, 2)
    whole = exact.decode(codes)
    short = _chunked(exact, codes, 4, 25, 2)
    assert short.shape == whole.shape and not torch.equal(short, whole)


def test_stock_kernels_would_not_be_exact(tiny_model, exact):
    """Negative control for the length-invariant kernels: transformers' own forward, decoding
    the same chunks with the whole receptive field as context, misses the whole decode."""
    codes = _codes(tiny_model, 120, 3)
    geo, module = exact.geometry, tiny_model.code2wav
    with torch.no_grad():
        whole = module(codes.unsqueeze(0)).reshape(-1)
        start, end = 90, 115
        context = geo.receptive_field_frames
        chunk = module(codes[:, start - context : end].unsqueeze(0)).reshape(-1)
    piece = chunk[-(end - start) * geo.samples_per_frame :]
    span = whole[start * geo.samples_per_frame - geo.trim : end * geo.samples_per_frame - geo.trim]
    assert piece.shape == span.shape and not torch.equal(piece, span)


def test_tiled_linear_rows_do_not_depend_on_length_or_offset(tiny_model):
    """The premise of the exact kernels, for every weight shape code2wav multiplies with."""
    shapes = set()
    for module in tiny_model.code2wav.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            w = weight.reshape(weight.shape[0], -1) if weight.dim() == 3 else weight
            shapes.add(tuple(w.shape))
            if weight.dim() == 3:  # transposed convs multiply [in] -> [out * kernel]
                shapes.add((weight.shape[1] * weight.shape[2], weight.shape[0]))
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in sorted(shapes):
        weight = torch.randn(out_features, in_features, generator=generator)
        rows = torch.randn(3000, in_features, generator=generator)
        full = tiled_linear(rows, weight)
        for start, count in [(0, 1), (0, 5), (3, 16), (17, 33), (100, 999), (1, 2999)]:
            assert torch.equal(
                tiled_linear(rows[start : start + count], weight), full[start : start + count]
            ), (out_features, in_features, start, count)


def test_column_product_columns_do_not_depend_on_length_or_offset(tiny_model):
    """The same premise for the decoder's channel-major convolutions, per tap weight shape."""
    shapes = {
        (m.weight.shape[0], m.weight.shape[1])
        for m in tiny_model.code2wav.decoder.modules()
        if isinstance(m, torch.nn.Conv1d) and m.groups == 1
    }
    for m in tiny_model.code2wav.decoder.modules():  # the transposed convs: [out * kernel, in]
        if isinstance(m, torch.nn.ConvTranspose1d):
            shapes.add((m.weight.shape[1] * m.weight.shape[2], m.weight.shape[0]))
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in sorted(shapes):
        weight = torch.randn(out_features, in_features, generator=generator)
        columns = torch.randn(in_features, 5000, generator=generator)
        full = column_product(weight, columns)
        for start, count in [(0, 1), (0, 5), (3, 16), (17, 33), (100, 999), (1, 4999)]:
            assert torch.equal(
                column_product(weight, columns[:, start : start + count]), full[:, start : start + count]
            ), (out_features, in_features, start, count)


# -- the engine ---------------------------------------------------------------------------------


def _drain(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def _engine(model, kernels="native", **chunking):
    runner = Code2WavRunner(model.code2wav, model.config.code2wav_config.num_quantizers, kernels)
    return ChunkedEngine(2, runner, **chunking)


@pytest.mark.parametrize("left_context,kernels", [(None, "native"), (10, "native"), (None, "torch")])
def test_engine_streams_chunks_that_add_up_to_the_whole_request(tiny_model, left_context, kernels):
    engine = _engine(
        tiny_model, kernels, initial_chunk_frames=3, chunk_frames=10, left_context_frames=left_context
    )
    assert engine.describe()["code2wav_kernels"] == kernels
    codes = _codes(tiny_model, 47, 4)
    params = SamplingParams()
    engine.add_request("whole", Code2WavPrompt("whole", codes), params)
    whole = [o for o in _drain(engine) if o.finished][0].output.audio

    empty = codes[:, :0]
    engine.add_request("s", Code2WavPrompt("s", empty, final=False), params, stream=True)
    assert not engine.has_unfinished_requests()  # waiting for frames is not work
    chunks, final = [], None
    for start, end in [(0, 2), (2, 9), (9, 9), (9, 30), (30, 47)]:
        engine.append_input("s", codes[:, start:end], final=end == 47)
        for out in _drain(engine):
            if out.chunk is not None:
                assert isinstance(out.chunk, AudioOutput)
                chunks.append(out.chunk.audio)
            if out.finished:
                final = out.output
    assert len(chunks) >= 5
    assert torch.equal(torch.cat(chunks), whole)
    # The samples left as chunks: the final output does not carry them again.
    assert final.samples_in_chunks and final.audio.numel() == 0 and final.metrics["chunks"] == len(chunks)
    assert engine.debug_state_counts() == {"code2wav.requests": 0}
    with pytest.raises(ValueError, match="holds no request"):
        engine.append_input("s", empty, final=True)


def test_engine_abort_mid_stream_frees_the_utterance(tiny_model):
    engine = _engine(tiny_model)
    codes = _codes(tiny_model, 30, 5)
    engine.add_request("a", Code2WavPrompt("a", codes[:, :0], final=False), SamplingParams(), stream=True)
    engine.append_input("a", codes[:, :10], final=False)
    assert any(o.chunk is not None for o in _drain(engine))
    engine.abort_request("a")
    assert engine.debug_state_counts() == {"code2wav.requests": 0}
    assert not engine.has_unfinished_requests()


def test_engine_refuses_bad_frames(tiny_model):
    engine = _engine(tiny_model)
    codes = _codes(tiny_model, 8, 6)
    engine.add_request("a", Code2WavPrompt("a", codes[:, :0], final=False), SamplingParams(), stream=True)
    with pytest.raises(ValueError, match=r"codes must be a \[4, frames\] tensor"):
        engine.append_input("a", codes[:2], final=False)
    engine.append_input("a", codes, final=True)
    with pytest.raises(ValueError, match="after the last ones"):
        engine.append_input("a", codes, final=True)


# -- the C kernels --------------------------------------------------------------------------------


def _native_call(
    kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dilation: int, steps: int
) -> torch.Tensor:
    """One C kernel call on the first `steps` columns of x (padded as the decoder pads)."""
    from omni_pd.models.qwen3_omni.hf import code2wav_native as native

    lib = native._library()
    width = native._width(steps)
    if kind == "snake":
        buf = torch.zeros((x.shape[0], width))
        buf[:, :steps] = x[:, :steps]
        out = torch.empty_like(buf)
        lib.omni_c2w_snake(
            buf.data_ptr(),
            width,
            out.data_ptr(),
            width,
            weight.data_ptr(),
            bias.data_ptr(),
            x.shape[0],
            width,
        )
        return out[:, :steps]
    c_out, c_in, kernel = weight.shape
    halo = (kernel - 1) * dilation
    padded = torch.zeros((c_in, halo + width))
    padded[:, : halo + steps] = x[:, : halo + steps]
    out = torch.empty((c_out, width))
    lib.omni_c2w_conv(
        padded.data_ptr(),
        padded.stride(0),
        out.data_ptr(),
        width,
        weight.data_ptr(),
        bias.data_ptr(),
        None,
        0,
        c_in,
        c_out,
        kernel,
        dilation,
        width,
    )
    return out[:, :steps]


def test_native_kernels_give_a_column_the_same_bits_at_any_length_or_offset(tiny_model):
    """The premise of the native decoder's exactness, for every convolution shape code2wav's
    decoder has (and SnakeBeta): a column's result depends on its inputs only."""
    from omni_pd.models.qwen3_omni.hf.code2wav_native import NativeDecoder

    decoder = NativeDecoder(tiny_model.code2wav)
    specs = {decoder.first, decoder.last}
    for block in decoder.blocks:
        specs.add(block.transposed.conv)
        for unit in block.units:
            specs.update((unit.conv1, unit.conv2))
    generator = torch.Generator().manual_seed(2)
    for spec in sorted(specs, key=lambda s: (s.c_in, s.weight.shape[0], s.kernel, s.dilation)):
        x = torch.randn(spec.c_in, spec.halo + 3000, generator=generator)
        full = _native_call("conv", x, spec.weight, spec.bias, spec.dilation, 3000)
        for start, count in [(0, 1), (0, 5), (3, 16), (17, 33), (100, 999), (1, 2999)]:
            part = _native_call("conv", x[:, start:], spec.weight, spec.bias, spec.dilation, count)
            assert torch.equal(part, full[:, start : start + count]), (spec.weight.shape, start, count)
    snake = decoder.blocks[-1].snake
    x = torch.randn(snake.alpha.numel(), 3000, generator=generator) * 4
    full = _native_call("snake", x, snake.alpha, snake.inverse, 1, 3000)
    reference = x + snake.inverse.unsqueeze(1) * torch.sin(x * snake.alpha.unsqueeze(1)) ** 2
    assert (full - reference).abs().max() < 1e-5
    for start, count in [(0, 1), (5, 17), (33, 2000)]:
        assert torch.equal(
            _native_call("snake", x[:, start:], snake.alpha, snake.inverse, 1, count),
            full[:, start : start + count],
        )


def test_native_decoder_is_the_torch_decoder_to_the_last_bits(tiny_model):
    codes = _codes(tiny_model, 60, 7)
    native = ExactCode2Wav(tiny_model.code2wav, "native").decode(codes)
    torch_ops = ExactCode2Wav(tiny_model.code2wav, "torch").decode(codes)
    assert native.shape == torch_ops.shape
    assert (native - torch_ops).abs().max() <= 1e-5 * torch_ops.abs().max()


def test_unknown_kernels_are_refused(tiny_model):
    with pytest.raises(ValueError, match="code2wav_kernels must be one of native, torch, not 'fast'"):
        ExactCode2Wav(tiny_model.code2wav, "fast")


def test_native_build_without_a_compiler_names_the_way_out(monkeypatch, tmp_path):
    from omni_pd.engines.hf import native_build
    from omni_pd.models.qwen3_omni.hf.code2wav_native import CODE2WAV

    monkeypatch.setenv("OMNI_PD_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(native_build.NativeBuildError, match="no C compiler found.*code2wav_kernels: torch"):
        native_build.build(CODE2WAV)


def test_native_build_is_cached_per_source_and_loads(monkeypatch, tmp_path):
    from omni_pd.engines.hf import native_build
    from omni_pd.models.qwen3_omni.hf.code2wav_native import CODE2WAV

    monkeypatch.setenv("OMNI_PD_CACHE_DIR", str(tmp_path))
    path = native_build.build(CODE2WAV)
    assert path.parent == tmp_path / "kernels" and path.is_file()
    assert native_build.build(CODE2WAV) == path  # the second call finds it
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial builds left behind
    assert hasattr(ctypes.CDLL(str(path)), "omni_c2w_conv")
