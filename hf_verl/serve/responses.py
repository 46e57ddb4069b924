"""The rollout server's answers in OpenAI's (and vLLM's) shapes: whole responses, stream chunks, usage.

Beyond OpenAI's fields, every choice carries `token_ids`, `prompt_token_ids` (in a stream: on the choice's
first chunk) and `weight_version`, and its log-probs (sampled tokens only, under hf_verl's log-prob
convention, :mod:`hf_verl.rollout.base`), which is what :class:`~hf_verl.rollout.remote.RemoteEngine` reads.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from starlette.responses import Response


def dumps(payload) -> bytes:
    """JSON as the old server wrote it (non-finite log-probs pass as `-Infinity`, which Python clients read)."""
    return json.dumps(payload, separators=(",", ":")).encode()


def json_response(payload, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(payload), status_code=status, headers=headers, media_type="application/json")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Delta:
    """What one decode step adds to one choice: its token (None: none), the new text, and the finish reason
    when the choice ends with it."""

    row: int
    token_id: int | None
    logprob: float | None
    text: str
    finish_reason: str | None = None


class Answer:
    """Builds the OpenAI objects of one request.

    Args:
        chat (`bool`): chat completions (`message` / `delta`) rather than completions (`text`).
        model (`str`): the served name.
        tokenizer: for log-prob token strings.
        logprobs (`bool`): chat only: whether log-probs are asked for (completions always carry them).
    """

    def __init__(self, chat: bool, model: str, tokenizer, logprobs: bool = True) -> None:
        self.chat, self.model, self.tokenizer, self.logprobs = chat, model, tokenizer, logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict | None:
        if not self.chat:
            return {"tokens": self.tokenizer.convert_ids_to_tokens(list(ids)), "token_logprobs": list(lps)}
        if not self.logprobs:
            return None
        words = [self.tokenizer.decode([t]) for t in ids]
        return {"content": [{"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": []}
                            for w, lp in zip(words, lps)]}

    def response(self, rows: list[tuple[list[int], list[float], str]], prompts: list[list[int]],
                 version: int, routed: list | None = None, token_versions: list | None = None) -> dict:
        """The whole answer: `rows` holds (token ids, log-probs, finish reason) per choice; `routed`, when given,
        each choice's routing record (`routed_experts`)."""
        choices = []
        for i, ((ids, lps, reason), prompt) in enumerate(zip(rows, prompts)):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            choice = {"index": i, "finish_reason": reason, "token_ids": list(ids), "prompt_token_ids": list(prompt),
                      "logprobs": self._logprobs(ids, lps), "weight_version": version}
            if routed is not None:
                choice["routed_experts"] = routed[i].tolist()
            if token_versions is not None:
                choice["token_weight_versions"] = list(token_versions[i])
            choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            choices.append(choice)
        completion_tokens = sum(len(ids) for ids, _, _ in rows)
        return {**self._head(False), "choices": choices, "weight_version": version,
                "usage": usage(sum(len(p) for p in prompts), completion_tokens)}

    def chunk(self, delta: Delta, prompt: list[int] | None, version: int) -> dict:
        """One stream chunk for `delta`; `prompt` is given on the choice's first chunk."""
        ids = [] if delta.token_id is None else [delta.token_id]
        lps = [] if delta.logprob is None else [delta.logprob]
        choice = {"index": delta.row, "finish_reason": delta.finish_reason, "token_ids": ids,
                  "logprobs": self._logprobs(ids, lps), "weight_version": version}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": delta.text} if prompt is not None else \
                {"content": delta.text}
        else:
            choice["text"] = delta.text
        if prompt is not None:
            choice["prompt_token_ids"] = list(prompt)
        return {**self._head(True), "choices": [choice], "weight_version": version}

    def usage_chunk(self, counts: dict) -> dict:
        return {**self._head(True), "choices": [], "usage": counts}
