"""Spoken English for the Realtime tests: espeak-ng, from the `espeakng-loader` wheel (which
bundles libespeak-ng and its voice data), called through ctypes. Only the first utterance of a
process is bit for bit reproducible (libespeak-ng keeps state between calls), which the tests do
not need: they compare what the server does with the samples they send."""

from __future__ import annotations

import ctypes
import functools

import espeakng_loader
import librosa
import numpy as np

_SYNCHRONOUS = 2  # AUDIO_OUTPUT_SYNCHRONOUS: espeak_Synth returns when the callback has it all
_CHARS_UTF8 = 1
_POS_CHARACTER = 1
_DONT_EXIT = 0x8000  # espeakINITIALIZE_DONT_EXIT: report errors instead of exiting
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
_chunks: list[np.ndarray] = []


@_CALLBACK
def _collect(wav, count, _events):
    if wav and count > 0:
        _chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
    return 0  # go on


@functools.cache
def _library() -> tuple[ctypes.CDLL, int]:
    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetSynthCallback.argtypes = [_CALLBACK]
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_Synth.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_uint,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    rate = lib.espeak_Initialize(_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), _DONT_EXIT)
    if rate <= 0:
        raise RuntimeError(f"espeak_Initialize failed ({rate})")
    lib.espeak_SetSynthCallback(_collect)
    if lib.espeak_SetVoiceByName(b"en") != 0:
        raise RuntimeError("espeak-ng has no 'en' voice")
    return lib, rate


def speak(text: str, rate: int = 24_000) -> np.ndarray:
    """`text` spoken, float32 mono at `rate`."""
    lib, native = _library()
    _chunks.clear()
    buffer = ctypes.create_string_buffer(text.encode())
    if lib.espeak_Synth(buffer, len(buffer), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None) != 0:
        raise RuntimeError("espeak_Synth failed")
    lib.espeak_Synchronize()
    samples = np.concatenate(_chunks).astype(np.float32) / 32768.0
    _chunks.clear()
    return librosa.resample(samples, orig_sr=native, target_sr=rate).astype(np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).round().astype("<i2").tobytes()
