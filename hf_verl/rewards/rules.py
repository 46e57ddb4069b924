"""Rule rewards for verifiable answers, built on Hugging Face's `math-verify`.

`math_accuracy` compares a completion's final answer with a gold solution symbolically (LaTeX,
fractions, plain numbers). `gsm8k_accuracy` reads GSM8K's gold format (`... #### 42`) and the
completion's last number (or its `#### N`). Both follow TRL's reward convention and return
None when the gold answer itself cannot be parsed (that sample is then ignored, not scored 0).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from math_verify import parse, verify

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise ValueError(f"a completion must be a string or a list of messages, got {type(completion).__name__}.")


def math_accuracy(completions: Sequence[Any], solution: Sequence[str], **kwargs: Any) -> list[float | None]:
    """1.0 where the completion's answer verifies against `solution`, else 0.0 (None: bad gold)."""
    out: list[float | None] = []
    for completion, gold in zip(completions, solution):
        gold_parsed = parse(gold)
        if not gold_parsed:
            out.append(None)
            continue
        out.append(1.0 if verify(gold_parsed, parse(_text(completion))) else 0.0)
    return out


def gsm8k_final_number(text: str) -> str | None:
    """The number after the last '####', else the last number in `text` (commas removed)."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def gsm8k_accuracy(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float | None]:
    """GSM8K accuracy: the completion's final number equals the gold `#### N` (numerically)."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        gold_num = gsm8k_final_number(gold) if "####" in gold else None
        if gold_num is None:
            out.append(None)
            continue
        pred = gsm8k_final_number(_text(completion))
        out.append(1.0 if pred is not None and verify(parse(gold_num), parse(pred)) else 0.0)
    return out
