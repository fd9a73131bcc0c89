"""The talker: thinker embeddings and hidden states in, codec codes out.

Builds the talker's input the way transformers' `Qwen3OmniMoeForConditionalGeneration.generate`
does for one sequence (user turns projected from the thinker, the assistant turn interleaved with
codec control tokens, the remaining assistant text fed one position per step), then runs the
talker's own `generate`.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from omni_pd.sampling import SamplingParams
from omni_pd.models.qwen3_omni.records import TalkerOutput, TalkerPrompt
from omni_pd.engines.hf import batch_invariant as bi


class _TrailingPlan(NamedTuple):
    """Trailing rows start .. end - 1 of a prompt: the first `token_rows` from thinker rows
    (`rows`, still to project; None when none is due), tts_eos after them, and the end-of-turn
    token's index (`eos`, None before it is known)."""

    start: int
    end: int
    token_rows: int
    eos: int | None
    rows: torch.Tensor | None


class TalkerModel:
    def __init__(self, talker: torch.nn.Module, thinker_embedding: torch.nn.Module, config):
        self.talker = talker
        self.thinker_embedding = thinker_embedding  # only for the tts_bos/eos/pad embeddings
        self.config = config  # the top-level Qwen3OmniMoeConfig
        self._specials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        tcfg = config.talker_config
        self.codec_eos = tcfg.codec_eos_token_id
        vocab = tcfg.text_config.vocab_size
        # As transformers does: the top 1024 ids are control codes the talker must not emit.
        self.suppressed = [i for i in range(max(vocab - 1024, 0), vocab) if i != self.codec_eos]
        self.multimodal_ids = {
            config.thinker_config.audio_token_id,
            config.thinker_config.image_token_id,
            config.thinker_config.video_token_id,
        }

    def speaker_id(self, speaker: str) -> int:
        speakers = self.config.talker_config.speaker_id or {}
        if speaker.lower() not in speakers:
            raise ValueError(f"unknown voice {speaker!r}; this model has {sorted(speakers)}")
        return speakers[speaker.lower()]

    def _project_text(self, rows: torch.Tensor) -> torch.Tensor:
        """The talker's text projection of thinker embedding rows [n, hidden], row-invariant
        (fixed 16-row tiles): a streamed talker projects rows as they arrive, a whole one all at
        once, and both must get the same bits."""
        mlp = self.talker.text_projection
        return bi.linear(
            bi.activation(mlp.act_fn)(bi.linear(rows, mlp.linear_fc1.weight, mlp.linear_fc1.bias)),
            mlp.linear_fc2.weight,
            mlp.linear_fc2.bias,
        )

    def _assistant_start(self, prompt: TalkerPrompt) -> int:
        # The ids read once: a transformers config attribute costs microseconds per access.
        ids, im_start, assistant = (
            prompt.prompt_token_ids,
            self.config.im_start_token_id,
            self.config.assistant_token_id,
        )
        starts = [i for i in range(len(ids) - 1) if ids[i] == im_start and ids[i + 1] == assistant]
        if not starts:
            raise ValueError(
                f"request {prompt.request_id}: the prompt has no "
                "'<|im_start|>assistant' turn; build it with add_generation_prompt"
            )
        return starts[-1]

    def _tts_specials(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projected tts_bos / tts_eos / tts_pad rows: fixed by the weights, so computed
        once (a streamed talker needs them for every thinker delta)."""
        if self._specials is None:
            cfg = self.config
            special = torch.tensor([[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]])
            with torch.no_grad():
                self._specials = self.talker.text_projection(self.thinker_embedding(special)).chunk(3, dim=1)
        return self._specials

    @torch.no_grad()
    def build_inputs(self, prompt: TalkerPrompt) -> dict[str, torch.Tensor]:
        """The talker's prefill input and trailing text rows for a whole thinker output."""
        inputs = self.prefill_inputs(prompt)
        inputs["trailing_text_hidden"] = self.trailing_rows(prompt, 0, final=True).unsqueeze(0)
        return inputs

    @torch.no_grad()
    def prefill_inputs(self, prompt: TalkerPrompt) -> dict[str, torch.Tensor]:
        """Everything but the trailing text: needs the thinker's rows through the first
        generated token (position prompt_len), which is all a streamed talker waits for."""
        cfg, tcfg = self.config, self.config.talker_config
        talker = self.talker
        prompt_len = len(prompt.prompt_token_ids)
        if prompt.thinker_embeds.shape[0] <= prompt_len:
            raise ValueError(
                f"request {prompt.request_id}: the talker needs the thinker's row for "
                f"its first generated token (position {prompt_len}); the thinker gave "
                f"{prompt.thinker_embeds.shape[0]} rows and {len(prompt.output_token_ids)} "
                "tokens (a one-token answer has no speech)"
            )
        embeds = prompt.thinker_embeds.unsqueeze(0)
        hidden = prompt.thinker_hidden.unsqueeze(0)
        ids = torch.tensor([prompt.prompt_token_ids], dtype=torch.long)
        multimodal = torch.tensor([[t in self.multimodal_ids for t in prompt.prompt_token_ids]])

        # User turns: a position belongs to the role named right after the latest <|im_start|>.
        user_positions, latest_start = [], 0
        im_start, user = cfg.im_start_token_id, cfg.user_token_id  # read once, not per token
        for index, token in enumerate(prompt.prompt_token_ids):
            if token == im_start:
                latest_start = index
            if prompt.prompt_token_ids[min(latest_start + 1, prompt_len - 1)] == user:
                user_positions.append(index)
        width = tcfg.text_config.hidden_size
        user_part = torch.empty((len(user_positions), width), dtype=embeds.dtype)
        if user_positions:
            pos = torch.tensor(user_positions)
            mm = multimodal[0, pos]
            if mm.any():
                user_part[mm] = talker.hidden_projection(hidden[0, pos][mm])
            if (~mm).any():
                user_part[~mm] = talker.text_projection(embeds[0, pos][~mm])
        user_ids = ids[0, user_positions] if user_positions else torch.zeros(0, dtype=torch.long)

        assistant_start = self._assistant_start(prompt)
        tts_bos, _, tts_pad = self._tts_specials()
        # The assistant turn's first four rows: <|im_start|>assistant\n and the first answer token.
        assistant = self._project_text(embeds[0, assistant_start : assistant_start + 4]).unsqueeze(0)
        assistant_text = torch.cat(
            (assistant[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant[:, 3:4]), dim=1
        )
        codec_specials = torch.tensor(
            [
                [
                    tcfg.codec_nothink_id,
                    tcfg.codec_think_bos_id,
                    tcfg.codec_think_eos_id,
                    self.speaker_id(prompt.speaker),
                    tcfg.codec_pad_id,
                    tcfg.codec_bos_id,
                ]
            ]
        )
        assistant_codec = torch.cat(
            (torch.zeros((1, 3, width), dtype=embeds.dtype), talker.get_input_embeddings()(codec_specials)),
            dim=1,
        )
        assistant_embeds = assistant_text + assistant_codec
        assistant_ids = torch.full((1, assistant_text.shape[1]), cfg.tts_pad_token_id, dtype=torch.long)
        return {
            "inputs_embeds": torch.cat((user_part.unsqueeze(0), assistant_embeds), dim=1),
            "tts_pad_embed": tts_pad,
            "talker_input_ids": torch.cat((user_ids.unsqueeze(0), assistant_ids), dim=1),
            "attention_mask": torch.ones(
                (1, len(user_positions) + assistant_embeds.shape[1]), dtype=torch.long
            ),
        }

    @torch.no_grad()
    def trailing_rows(self, prompt: TalkerPrompt, start: int, final: bool) -> torch.Tensor:
        """Rows `start`, `start + 1`, ... of the trailing text (one per talker decode step).

        As transformers builds it for a whole output: the thinker rows after the assistant
        turn's first four, then tts_eos; at the thinker's first end-of-turn token e (or at the
        number of generated tokens, without one) row e becomes tts_eos and later rows pads (the
        talker pads past the end too). Until the thinker is done (`final`), only the rows that
        more thinker output cannot change are returned: fed-back token rows before any
        end-of-turn and before the generated-token count."""
        return self.trailing_rows_many([(prompt, start, final)])[0]

    def trailing_rows_many(self, wanted: list[tuple[TalkerPrompt, int, bool]]) -> list[torch.Tensor]:
        """`trailing_rows` for several (prompt, start, final), their thinker rows projected in
        one pass: the projection's fixed tiles give a row the same bits in any pass, and a
        streamed talker step gets one new row per request, so one pass for all requests costs
        what one request's did."""
        plans = [self._trailing_plan(*item) for item in wanted]
        raw = [plan.rows for plan in plans if plan is not None and plan.rows is not None]
        projected = self._project_text(torch.cat(raw)) if raw else None
        out, offset = [], 0
        for (prompt, _, _), plan in zip(wanted, plans):
            if plan is None:
                width = self.config.talker_config.text_config.hidden_size
                out.append(torch.zeros((0, width), dtype=prompt.thinker_embeds.dtype))
                continue
            start, end, token_rows, eos, rows = plan
            pieces = []
            if rows is not None:
                pieces.append(projected[offset : offset + rows.shape[0]])
                offset += rows.shape[0]
            _, tts_eos, tts_pad = self._tts_specials()
            if end > token_rows:
                pieces.append(tts_eos[0])  # final only: the row after the last fed-back token
            trailing = torch.cat(pieces)
            if eos is not None:
                column = torch.arange(start, end).view(-1, 1)
                trailing = torch.where(column > eos, tts_pad[0], trailing)
                trailing = torch.where(column == eos, tts_eos[0], trailing)
            out.append(trailing.contiguous())
        return out

    def _trailing_plan(self, prompt: TalkerPrompt, start: int, final: bool) -> _TrailingPlan | None:
        """What `trailing_rows` builds, None when no row is due."""
        cfg = self.config
        first = self._assistant_start(prompt) + 4  # the thinker row of trailing row 0
        token_rows = max(prompt.thinker_embeds.shape[0] - first, 0)
        tokens = prompt.output_token_ids
        im_end = cfg.im_end_token_id
        eos = next((i for i, t in enumerate(tokens) if t == im_end), None)
        if final:
            end = token_rows + 1  # + tts_eos
            eos = len(tokens) if eos is None else eos
        else:
            end = min(token_rows, eos if eos is not None else len(tokens))
        if end <= start:
            return None
        rows = None
        if min(end, token_rows) > start:
            rows = prompt.thinker_embeds[first + start : first + min(end, token_rows)]
        return _TrailingPlan(start, end, token_rows, eos, rows)

    @torch.no_grad()
    def generate(self, prompt: TalkerPrompt, params: SamplingParams) -> TalkerOutput:
        began = time.perf_counter()
        inputs = self.build_inputs(prompt)
        kwargs = dict(
            max_new_tokens=params.max_tokens,
            do_sample=not params.greedy,
            eos_token_id=self.codec_eos,
            repetition_penalty=params.repetition_penalty,
            # ignore_eos: never sample the codec EOS (it has no frame), run to max_tokens
            suppress_tokens=self.suppressed + ([self.codec_eos] if params.ignore_eos else []),
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
        if not params.greedy:
            kwargs.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else 0,
            )
        # The talker samples through torch's global generator (code predictor included): seed it
        # per request, inside fork_rng so no other request's randomness moves.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed if params.seed is not None else 0)
            result = self.talker.generate(**inputs, **kwargs)
        steps = [h[-1] for h in result.hidden_states if h[-1] is not None]
        codes = (
            torch.stack(steps, dim=1)[0].transpose(0, 1)
            if steps
            else torch.zeros((self.config.talker_config.num_code_groups, 0), dtype=torch.long)
        )
        return TalkerOutput(
            request_id=prompt.request_id,
            codes=codes.to(torch.long).contiguous(),
            metrics={"talker_ms": (time.perf_counter() - began) * 1e3},
        )
