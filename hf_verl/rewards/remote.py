"""Reward models behind a URL: scored through vLLM's `/classify` route (`hf-verl serve` or `vllm serve`).

:class:`RemoteRewardModel` is a reward function (TRL's calling convention) that joins each prompt and
completion into the text the reward model scores (standard format: `prompt + completion`; conversational:
rendered by the reward model's chat template, which needs its tokenizer), and sends the texts in requests of
`batch_size` to `POST {url}/classify` with `use_activation: false` and `add_special_tokens: false` (as the local
:class:`~hf_verl.rewards.reward_model.RewardModelScorer` tokenises), reading each score as `probs[0]`: the raw
logit of a `num_labels=1` model. Connection failures, timeouts, 429 and 5xx answers are retried with exponential
backoff up to `max_retries` times; then, and on any answer that is not a classification of every text (4xx,
not JSON, missing or extra rows, non-finite scores, a model with more than one label), a
:class:`RewardServerError` names the role and the URL, which fails the step.
"""

from __future__ import annotations

import logging
import math
import numbers
import urllib.parse
from collections.abc import Sequence
from typing import Any

from hf_verl._http import post_json
from hf_verl.data.prompts import is_conversational

logger = logging.getLogger(__name__)

ROUTES = ("/classify", "/v1/classify")


class RewardServerError(RuntimeError):
    """A reward (or other role's) server is unreachable or answered something that is not a score per text."""


def is_url(source: Any) -> bool:
    """Whether a role's source is a server URL (`http://` or `https://`) rather than a Hub id or path."""
    return isinstance(source, str) and source.lower().startswith(("http://", "https://"))


def classify_endpoint(url: str) -> str:
    """The `/classify` endpoint of `url`: a server's base URL gets `/classify` appended; a URL that already ends
    in `/classify` or `/v1/classify` is kept.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"reward model URL {url!r} must look like http://127.0.0.1:8000 (a server's base URL) or "
                         "http://host:port/classify")
    path = parts.path.rstrip("/")
    if not path.endswith(ROUTES):
        path += "/classify"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def parse_scores(answer: Any, expected: int) -> list[float]:
    """The reward of each of `expected` texts from a `/classify` answer (vLLM's shape), in input order.

    Raises:
        ValueError: saying what is wrong with the answer.
    """
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError(f"the answer is not a classification response (no 'data' list): {str(answer)[:200]}")
    if len(data) != expected:
        raise ValueError(f"the answer has {len(data)} results for {expected} texts")
    scores: list[float | None] = [None] * expected
    for pos, item in enumerate(data):
        index = item.get("index", pos) if isinstance(item, dict) else None
        probs = item.get("probs") if isinstance(item, dict) else None
        if not isinstance(index, int) or not 0 <= index < expected or scores[index] is not None:
            raise ValueError(f"result {pos} has a missing, repeated or out-of-range 'index': {str(item)[:120]}")
        if not isinstance(probs, list) or not probs:
            raise ValueError(f"result {pos} has no 'probs' list: {str(item)[:120]}")
        if len(probs) != 1:
            raise ValueError(f"the served model has {len(probs)} labels; a reward model has one (num_labels=1)")
        value = probs[0]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"result {pos} scores {value!r}, not a finite number")
        scores[index] = float(value)
    return scores  # type: ignore[return-value]


class RemoteRewardModel:
    """A reward function scored by a reward model behind a URL (see the module docstring).

    Args:
        url (`str`): the server's base URL (e.g. `"http://127.0.0.1:8000"`) or its `/classify` endpoint.
        model (`str`, *optional*): the `model` field of requests (a served name); omitted by default.
        tokenizer (*optional*): the reward model's tokenizer, needed for conversational prompts (its chat
            template renders the messages).
        role (`str`, defaults to `"reward"`): the role named in errors.
        batch_size (`int`, defaults to 32): texts per request.
        timeout_s (`float`, defaults to 60): seconds to wait for one answer.
        max_retries (`int`, defaults to 3): retries of a failed request (connection, timeout, 429, 5xx).
        backoff_s (`float`, defaults to 0.5): the first wait between retries (doubled each time).
        token (`str`, *optional*): sent as `Authorization: Bearer <token>`.

    Raises:
        ValueError: a URL that is not http(s), or batch_size / max_retries / timeout_s out of range.
    """

    def __init__(self, url: str, *, model: str | None = None, tokenizer: Any = None, role: str = "reward",
                 batch_size: int = 32, timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5,
                 token: str | None = None) -> None:
        if batch_size < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError(f"{role} model at {url}: batch_size must be >= 1, max_retries >= 0 and timeout_s > 0 "
                             f"(got {batch_size}, {max_retries}, {timeout_s})")
        self.url = classify_endpoint(url)
        self.model, self.tokenizer, self.role = model, tokenizer, role
        self.batch_size, self.timeout_s, self.max_retries, self.backoff_s = batch_size, timeout_s, max_retries, backoff_s
        self._token = token
        self.__name__ = model.rstrip("/").split("/")[-1] if model else urllib.parse.urlsplit(self.url).netloc

    def __repr__(self) -> str:
        return f"RemoteRewardModel({self.url!r}, role={self.role!r})"

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The strings the reward model scores (as :class:`~hf_verl.rewards.reward_model.RewardModelScorer`)."""
        out = []
        for p, c in zip(prompts, completions):
            if is_conversational(p):
                if self.tokenizer is None:
                    raise ValueError(f"{self.role} model at {self.url}: conversational prompts are rendered with the "
                                     "reward model's chat template; pass its tokenizer (reward_processing_classes / "
                                     "reward_tokenizer), or use standard (text) prompts.")
                out.append(self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False))
            else:
                out.append(p + c)
        return out

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
        return self.score_texts(self.texts(prompts, completions))

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """The reward of each text, `batch_size` texts per request.

        Raises:
            RewardServerError: the server is down after the retries, or answered something unusable.
        """
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            chunk = list(texts[i : i + self.batch_size])
            body = {"input": chunk, "use_activation": False, "add_special_tokens": False}
            if self.model is not None:
                body["model"] = self.model
            answer = self._post(body)
            try:
                scores.extend(parse_scores(answer, len(chunk)))
            except ValueError as err:
                raise RewardServerError(f"{self.role} model at {self.url} answered garbage: {err}") from None
        return scores

    def _post(self, body: dict) -> Any:
        return post_json(self.url, body, who=f"{self.role} model at {self.url}", error=RewardServerError,
                         token=self._token, timeout_s=self.timeout_s, max_retries=self.max_retries,
                         backoff_s=self.backoff_s,
                         hint="Start the server (`hf-verl serve <reward model>`) or fix the URL.")
