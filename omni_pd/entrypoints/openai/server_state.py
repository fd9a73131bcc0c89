"""What the server app holds: the orchestrator once it is up, its metrics, admission and open
realtime sessions."""

from __future__ import annotations

from ...orchestrator.async_omni import AsyncOmni
from .admission import AdmissionControl, Slot
from .metrics import ServerMetrics
from .protocol import APIError
from .realtime.session import RealtimeSession


class ServerState:
    """What the app holds: the orchestrator once it is up, and its metrics."""

    def __init__(
        self,
        served_model: str,
        stream_audio_form: str = "openai",
        trace_hops: bool = False,
        default_modalities: tuple[str, ...] = ("text",),
    ) -> None:
        self.served_model = served_model
        self.stream_audio_form = stream_audio_form  # chat_stream.AUDIO_FORMS
        self.default_modalities = default_modalities  # a chat request's when it names none
        self.trace_hops = trace_hops  # answers carry their request's timeline (hop_trace.py)
        self.omni: AsyncOmni | None = None
        self.startup_error: str | None = None
        self.pcm16_gain = 1.0  # set from the stage config once the stages are up
        self.metrics = ServerMetrics()
        self.admission: AdmissionControl | None = None  # set once the stages are up
        self.realtime_sessions: set[RealtimeSession] = set()  # open /v1/realtime sockets

    def ready_omni(self) -> AsyncOmni:
        """The orchestrator, or a 503 saying why there is none yet."""
        if self.omni is None:
            raise APIError(
                503,
                self.startup_error or "the stages are still starting; retry when GET /health answers 200",
                type="service_unavailable",
            )
        return self.omni

    async def admit(self) -> Slot:
        """A slot in the stages, or (counted as overloaded) the 429 the queue gives."""
        try:
            return await self.admission.enter()
        except APIError:
            self.metrics.requests.labels(outcome="overloaded").inc()
            raise
