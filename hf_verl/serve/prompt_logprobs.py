"""Prompt log-probs of `hf-verl serve`: what `/v1/completions` answers to `echo` and `prompt_logprobs`.

vLLM's completions request scores a prompt two ways, and this server takes both:

- `echo: true` with `logprobs: N` (OpenAI's field): the choice's `logprobs` covers the prompt's tokens and then the
  generated ones, `token_logprobs[0]` being `null` (the first token is not conditioned on anything), and its
  `text` is the prompt's text followed by the completion's. `max_tokens: 0` (allowed only with `echo`) generates
  nothing: the prompt is only scored, which is how a reference model behind a URL is read
  (:class:`~hf_verl.engine.remote_reference.RemoteReference`);
- `prompt_logprobs: K` (vLLM's field): the choice carries `prompt_logprobs`, `[null, {"<token id>": {"logprob",
  "rank", "decoded_token"}, ...}, ...]`: per prompt position the prompt token's own entry plus the `K` most
  likely tokens (`rank` 1 is the most likely).

Log-probs follow the server's convention (:mod:`hf_verl.rollout.base`): `log_softmax(logits / temperature)` with
the request's `temperature` (0 or 1: the raw distribution), computed as the training engines compute them.
vLLM's own server reports prompt log-probs of the raw distribution whatever the temperature; a client that needs
a temperature other than 1 can tell the servers apart by `prompt_logprobs_temperature`, which this server adds to
each choice that carries prompt log-probs.

Scoring needs the model's forward pass, so it is answered by a server whose engine holds a transformers model
(`--engine transformers`, the default); prompts are scored `rows` at a time, right-padded, the LM head a chunk
of positions at a time in float32.
"""

from __future__ import annotations

import torch

PromptScores = list[list[float]]


@torch.no_grad()
def score_prompts(model: torch.nn.Module, prompts: list[list[int]], *, temperature: float, pad_token_id: int,
                  top: int | None = None, rows: int = 16,
                  chunk_size: int = 1024) -> tuple[PromptScores, list[list[dict[int, tuple[float, int]]]]]:
    """The log-prob of every prompt token after the first, under `model`.

    The LM head runs on the final hidden states `chunk_size` positions at a time
    (:func:`~hf_verl.algorithms.logprobs.logprobs_from_head`, as the training engines score), so a long prompt
    over a large vocabulary never holds all its logits at once.

    Args:
        model (`torch.nn.Module`): a causal LM (its logits at position `t` predict token `t + 1`).
        prompts (`list[list[int]]`): token ids, each at least one token.
        temperature (`float`): logits are divided by it (0 is taken as 1).
        pad_token_id (`int`): fills the right padding (masked out).
        top (`int`, *optional*): also return, per position, the prompt token's entry (log-prob and rank) and the
            `top` most likely tokens' (0: the prompt token's only); None: no entries.
        rows (`int`, defaults to 16): prompts per forward pass.
        chunk_size (`int`, defaults to 1024): positions per LM-head call.

    Returns:
        `(scores, alternatives)`: `scores[i][t]` is the log-prob of `prompts[i][t + 1]` (so `len(prompts[i]) - 1`
        values); `alternatives[i][t]` maps token ids to `(log-prob, rank)` for the prompt token and the `top`
        most likely ones (empty dicts when `top` is None).
    """
    from hf_verl.algorithms.logprobs import logprobs_from_head

    scale = temperature if temperature > 0 else 1.0
    device = next(model.parameters()).device
    head = model.get_output_embeddings()
    scores: PromptScores = []
    alternatives: list[list[dict[int, tuple[float, int]]]] = []
    for start in range(0, len(prompts), max(1, rows)):
        chunk = prompts[start : start + max(1, rows)]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, prompt in enumerate(chunk):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                    use_cache=False, logits_to_keep=1)
        hidden = out.hidden_states[-1]
        del out
        for row, prompt in enumerate(chunk):
            n = len(prompt) - 1
            target = torch.tensor(prompt[1:], dtype=torch.long, device=device)
            own = logprobs_from_head(hidden[row, :n], head, target, temperature=scale, chunk_size=chunk_size)[0]
            scores.append(own.float().cpu().tolist())
            alternatives.append([{} for _ in range(n)] if top is None else
                                _alternatives(hidden[row, :n], head, target, own, scale, top, chunk_size))
    return scores, alternatives


def _alternatives(hidden: torch.Tensor, head, target: torch.Tensor, own: torch.Tensor, scale: float, top: int,
                  chunk_size: int) -> list[dict[int, tuple[float, int]]]:
    """Per position: `{token id: (log-prob, rank)}` for the prompt token and the `top` most likely tokens."""
    out = []
    for s in range(0, target.numel(), max(1, chunk_size)):
        logp = torch.log_softmax(head(hidden[s : s + chunk_size]).float() / scale, dim=-1)
        mine = own[s : s + chunk_size].float()
        # ranks against the same rounding as the others' log-probs (the token never outranks itself)
        ranks = (logp > logp.gather(-1, target[s : s + chunk_size].unsqueeze(-1))).sum(-1) + 1
        best, best_ids = logp.topk(min(top, logp.shape[-1]), dim=-1)  # top=0: none
        for t in range(logp.shape[0]):
            entry = {int(i): (float(v), r + 1) for r, (v, i) in enumerate(zip(best[t], best_ids[t]))}
            entry[int(target[s + t])] = (float(mine[t]), int(ranks[t]))
            out.append(entry)
    return out


def prompt_logprobs_field(alternatives: list[dict[int, tuple[float, int]]], tokenizer) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of one choice: `None` for the first token, then `{"<id>": {"logprob", "rank",
    "decoded_token"}}` per position."""
    out: list[dict | None] = [None]
    for entry in alternatives:
        out.append({str(i): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([i])}
                    for i, (lp, rank) in entry.items()})
    return out


def add_prompt_scores(answer: dict, req, prompt_ids: list[list[int]], scores: PromptScores,
                      alternatives: list[list[dict[int, tuple[float, int]]]], tokenizer) -> dict:
    """`answer` (a completions response, `req.n` choices per prompt) with the prompts' scores as vLLM puts them:
    with `echo`, the prompt's text before `text` and its tokens before `logprobs.tokens` / `token_logprobs`
    (`null` first); with `prompt_logprobs`, the choice's `prompt_logprobs`. Usage is unchanged (the prompt tokens
    are counted once per prompt already)."""
    for choice in answer["choices"]:
        i = choice["index"] // req.n
        if req.echo:
            prompt = req.prompts[i]
            text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids[i], skip_special_tokens=True)
            choice["text"] = text + choice["text"]
            logprobs = choice["logprobs"] or {"tokens": [], "token_logprobs": []}
            choice["logprobs"] = {"tokens": tokenizer.convert_ids_to_tokens(list(prompt_ids[i])) + logprobs["tokens"],
                                  "token_logprobs": [None, *scores[i], *logprobs["token_logprobs"]]}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(alternatives[i], tokenizer)
        choice["prompt_logprobs_temperature"] = req.temperature if req.temperature > 0 else 1.0
    return answer
