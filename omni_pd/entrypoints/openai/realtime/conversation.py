"""A Realtime session's conversation: its items in order, and the chat messages they make.

Every response runs the whole conversation through the pipeline: user audio as the thinker's
audio input (resampled once, when the item is added, so a later turn resends the same samples
and the prefix cache reuses their blocks), user text as text, the assistant's earlier answers as
their text (for a spoken answer, its transcript as far as the listener heard it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .audio import decode_pcm16, duration_ms, pcm16_to_model_rate
from .events import ItemIn, RealtimeError, new_id


@dataclass
class Part:
    type: str  # input_text, input_audio, output_text, output_audio
    text: str = ""  # input_text / output_text
    transcript: str | None = None  # input_audio / output_audio
    audio: np.ndarray | None = None  # input_audio: float32 at the model's rate
    audio_ms: int = 0  # input_audio: its length; output_audio: the audio sent
    spoken_text: str = ""  # output_audio: the whole answer, which `transcript` may cut short

    def public(self) -> dict[str, Any]:
        """As the protocol shows a part (audio bytes are never echoed back)."""
        if self.type in ("input_text", "output_text"):
            return {"type": self.type, "text": self.text}
        return {"type": self.type, "transcript": self.transcript}


@dataclass
class Item:
    id: str
    role: str
    parts: list[Part] = field(default_factory=list)
    status: str = "completed"

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "object": "realtime.item",
            "status": self.status,
            "role": self.role,
            "content": [p.public() for p in self.parts],
        }


def item_from_client(spec: ItemIn) -> Item:
    """A `conversation.item.create` item; its audio decoded (RealtimeError names a bad part)."""
    parts = []
    for index, part in enumerate(spec.content):
        where = f"item.content[{index}]"
        kind = {"text": "output_text", "audio": "output_audio"}.get(part.type, part.type)  # beta
        allowed = {
            "user": ("input_text", "input_audio"),
            "system": ("input_text",),
            "assistant": ("output_text", "output_audio"),
        }[spec.role]
        if kind not in allowed:
            raise RealtimeError(
                f"a {spec.role} item takes content of type {' or '.join(allowed)}, not {part.type!r}",
                param=f"{where}.type",
            )
        if kind == "input_audio":
            if not part.audio:
                raise RealtimeError(
                    "an input_audio part needs `audio`: base64 pcm16, 24 kHz mono", param=f"{where}.audio"
                )
            pcm = decode_pcm16(part.audio, f"{where}.audio")
            if not pcm:
                raise RealtimeError("the input_audio part holds no samples", param=f"{where}.audio")
            parts.append(
                Part(
                    kind,
                    transcript=part.transcript,
                    audio=pcm16_to_model_rate(pcm),
                    audio_ms=duration_ms(pcm),
                )
            )
        elif kind == "output_audio":
            text = part.transcript or ""
            parts.append(Part(kind, transcript=text, spoken_text=text))
        else:
            if part.text is None:
                raise RealtimeError(f"an {kind} part needs `text`", param=f"{where}.text")
            parts.append(Part(kind, text=part.text))
    return Item(spec.id or new_id("item"), spec.role, parts)


class Conversation:
    def __init__(self) -> None:
        self.items: list[Item] = []

    def find(self, item_id: str, param: str = "item_id") -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise RealtimeError(f"no item {item_id!r} in this conversation", param=param, code="item_not_found")

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Append (or insert after `previous_item_id`; "root": first); returns the id of the
        item before it."""
        if any(i.id == item.id for i in self.items):
            raise RealtimeError(
                f"the conversation has an item {item.id!r} already",
                param="item.id",
                code="item_already_exists",
            )
        if previous_item_id is None:
            index = len(self.items)
        elif previous_item_id == "root":
            index = 0
        else:
            index = self.items.index(self.find(previous_item_id, "previous_item_id")) + 1
        self.items.insert(index, item)
        return self.items[index - 1].id if index else None

    def delete(self, item_id: str) -> None:
        self.items.remove(self.find(item_id))

    def messages(self, instructions: str) -> list[dict[str, Any]]:
        """The chat messages of the conversation (omni-pd's prompt form), instructions first."""
        messages: list[dict[str, Any]] = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
        for item in self.items:
            if item.role == "user":
                content = [
                    {"type": "text", "text": p.text}
                    if p.type == "input_text"
                    else {"type": "audio", "audio": p.audio}
                    for p in item.parts
                ]
                messages.append({"role": "user", "content": content})
            else:
                text = "".join(p.text if p.type.endswith("text") else p.transcript or "" for p in item.parts)
                if text:  # an answer cut before a word was heard says nothing
                    messages.append({"role": item.role, "content": text})
        return messages
