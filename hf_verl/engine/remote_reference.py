"""`RemoteReference`: a KL reference model behind a URL, read through `/v1/completions` prompt log-probs.

The reference only scores: for each rollout row it sends the row's tokens (prompt then completion, padding
dropped) as the prompt of a completions request with `echo: true`, `max_tokens: 0` and `logprobs: 0`, which
vLLM's server and `hf-verl serve` both answer with the log-prob of every prompt token after the first
(`logprobs.token_logprobs`, `null` first; :mod:`hf_verl.serve.prompt_logprobs`). The completion's part of those
is the reference's `(B, C)` log-probs. It stands where a reference engine stands
(:func:`hf_verl.pipeline.phases.reference_logprobs`): `infer(batch, LogProbs(...))`, also behind
:class:`~hf_verl.pipeline.cross_tokenizer.CrossTokenizer` when the served model has another tokenizer. It is the
scoring part of an engine alone (:class:`~hf_verl.engine.parts.scoring.ScoringEngine`): no step, no weights.

Temperature: hf_verl scores at the sampling temperature (:mod:`hf_verl.rollout.base`). `hf-verl serve` applies the
request's `temperature` to prompt log-probs and says so in each choice (`prompt_logprobs_temperature`); vLLM's
server reports the raw distribution whatever the temperature, so against a server that does not say, a run that
samples at a temperature other than 1 fails with an error instead of using log-probs of another distribution.

Requests carry `rows_per_request` rows, `max_concurrency` in flight. Connection failures, timeouts, 429 and 5xx are
retried with exponential backoff (`max_retries`, `backoff_s`, `timeout_s`); then, and on any answer that is not a
log-prob per token of every row, a :class:`ReferenceServerError` names the role and the URL.
"""

from __future__ import annotations

import logging
import math
import numbers
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hf_verl._http import post_json
from hf_verl.engine.parts.scoring import ScoringEngine

logger = logging.getLogger(__name__)


class ReferenceServerError(RuntimeError):
    """A reference server is unreachable or answered something that is not a log-prob per token."""


def completions_endpoint(url: str) -> str:
    """The `/v1/completions` endpoint of `url`: a server's base URL (`http://host:port`) or its OpenAI base
    (`http://host:port/v1`) gets the rest appended; a URL ending in `/completions` is kept.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"reference URL {url!r} must look like http://127.0.0.1:8000/v1 (an OpenAI-compatible "
                         "server's base URL)")
    path = parts.path.rstrip("/")
    if not path.endswith("/completions"):
        path += "/completions" if path.endswith("/v1") else "/v1/completions"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def parse_echo(answer: Any, sequences: list[list[int]], temperature: float) -> list[list[float]]:
    """Each sequence's token log-probs after its first token, from an `echo` completions answer.

    Raises:
        ValueError: saying what is wrong with the answer.
    """
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != len(sequences):
        count = len(choices) if isinstance(choices, list) else "no"
        raise ValueError(f"the answer has {count} choices for {len(sequences)} sequences: {str(answer)[:200]}")
    out: list[list[float] | None] = [None] * len(sequences)
    for pos, choice in enumerate(choices):
        index = choice.get("index", pos) if isinstance(choice, dict) else None
        if not isinstance(index, int) or not 0 <= index < len(sequences) or out[index] is not None:
            raise ValueError(f"choice {pos} has a missing, repeated or out-of-range 'index'")
        applied = choice.get("prompt_logprobs_temperature", 1.0)
        if not math.isclose(float(applied), temperature, rel_tol=1e-6):
            raise ValueError(f"its prompt log-probs are at temperature {applied} but the run scores at {temperature} "
                             "(vLLM's server reports the raw distribution): serve the reference with `hf-verl serve`, "
                             "which applies the request's temperature, or sample at temperature 1.0")
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        ids = sequences[index]
        if not isinstance(values, list) or len(values) != len(ids):
            got = len(values) if isinstance(values, list) else "no"
            raise ValueError(f"choice {pos} has {got} token_logprobs for {len(ids)} tokens (echo unsupported?)")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != list(ids):
            raise ValueError(f"choice {pos} scored other tokens than it was sent (prompt_token_ids differ)")
        scores = values[1:]
        if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) for v in scores):
            raise ValueError(f"choice {pos} has log-probs that are not finite numbers: {str(scores)[:120]}")
        out[index] = [float(v) for v in scores]
    return out  # type: ignore[return-value]


class RemoteReference(ScoringEngine):
    """A KL reference served behind a URL (see the module docstring).

    Args:
        url (`str`): the server's base URL (`http://127.0.0.1:8000` or `http://127.0.0.1:8000/v1`).
        model (`str`, *optional*): the `model` field of requests (a served name); omitted by default.
        role (`str`, defaults to `"reference"`): the role named in errors.
        rows_per_request (`int`, defaults to 16), max_concurrency (`int`, defaults to 4): requests' size and how
            many are in flight.
        timeout_s (`float`, defaults to 60), max_retries (`int`, defaults to 3), backoff_s (`float`, defaults to
            0.5): per request, retries of a failed one (connection, timeout, 429, 5xx) and the first wait between
            them (doubled each time).
        token (`str`, *optional*): sent as `Authorization: Bearer <token>`.

    Raises:
        ValueError: a URL that is not http(s), or a size / retry / timeout out of range.
    """

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, url: str, *, model: str | None = None, role: str = "reference", rows_per_request: int = 16,
                 max_concurrency: int = 4, timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5,
                 token: str | None = None) -> None:
        if rows_per_request < 1 or max_concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError(f"{role} at {url}: rows_per_request and max_concurrency must be >= 1, max_retries >= 0 "
                             f"and timeout_s > 0 (got {rows_per_request}, {max_concurrency}, {max_retries}, "
                             f"{timeout_s})")
        self.url = completions_endpoint(url)
        self.model, self.role = model, role
        self.rows_per_request, self.max_concurrency = rows_per_request, max_concurrency
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self._token = token

    def __repr__(self) -> str:
        return f"RemoteReference({self.url!r}, role={self.role!r})"

    def infer(self, batch: Any, forward: Any, *, micro_batch: int | None = None) -> Any:
        """The reference's `(B, C)` log-probs of `batch`'s completion tokens (0 on padding), as a reference
        engine's `infer(batch, LogProbs(...))` answers them; `micro_batch` is ignored (rows go
        `rows_per_request` to a request).

        Raises:
            TypeError: a request other than :class:`~hf_verl.engine.step.LogProbs` (a served reference only
                scores tokens).
            ReferenceServerError: the server is down after the retries, or answered something unusable.
        """
        from hf_verl.engine.step import LogProbs, PolicyOutput

        if not isinstance(forward, LogProbs) or forward.with_entropy or forward.with_aux_loss:
            raise TypeError(f"the {self.role} at {self.url} only scores tokens (LogProbs without entropy), not "
                            f"{forward!r}")
        prompts, completions = [], []
        for row in range(batch.batch_size):
            prompts.append(batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist())
            completions.append(batch.completion_ids[row][batch.completion_mask[row].bool()].tolist())
        scores = self.score([p + c for p, c in zip(prompts, completions)], temperature=forward.temperature)
        out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            cols = batch.completion_mask[row].bool().nonzero().flatten().cpu()
            out[row, cols] = torch.tensor(scores[row][len(prompt) - 1 :], dtype=torch.float32)
        return PolicyOutput(logp=out.to(batch.completion_mask.device))

    def score(self, sequences: list[list[int]], *, temperature: float = 1.0) -> list[list[float]]:
        """The log-prob of every token of each sequence after its first, under the served model.

        Raises:
            ValueError: an empty sequence.
            ReferenceServerError: see :meth:`infer`.
        """
        if any(not s for s in sequences):
            raise ValueError(f"the {self.role} at {self.url} scores sequences of at least one token")
        chunks = [sequences[i : i + self.rows_per_request] for i in range(0, len(sequences), self.rows_per_request)]

        def send(chunk: list[list[int]]) -> list[list[float]]:
            body = {"prompt": chunk, "echo": True, "max_tokens": 0, "logprobs": 0, "temperature": temperature,
                    "return_token_ids": True, "return_tokens_as_token_ids": True}
            if self.model is not None:
                body["model"] = self.model
            answer = self._post(body)
            try:
                return parse_echo(answer, chunk, temperature)
            except ValueError as err:
                raise ReferenceServerError(f"{self.role} at {self.url} answered garbage: {err}") from None

        if len(chunks) == 1:
            return send(chunks[0])
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(chunks))) as pool:
            return [row for part in pool.map(send, chunks) for row in part]

    def _post(self, body: dict) -> Any:
        return post_json(self.url, body, who=f"{self.role} at {self.url}", error=ReferenceServerError,
                         token=self._token, timeout_s=self.timeout_s, max_retries=self.max_retries,
                         backoff_s=self.backoff_s,
                         hint="Start the server (`hf-verl serve <reference model>`) or fix the URL.")
