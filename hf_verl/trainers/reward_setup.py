"""Getting a reward model and its tokenizer ready for :class:`~hf_verl.trainers.reward_trainer.RewardTrainer`.

TRL's rules: a model given by id or path loads as `AutoModelForSequenceClassification` with one label (a causal
LM checkpoint gets a new, randomly initialised `score` head; the seed is set first so that the head is the same
on every run and every rank); a model object must already have `num_labels=1`. The tokenizer's EOS can be replaced
(`eos_token`), its chat template taken from a file or another tokenizer (`chat_template_path`), and its pad token
is the configured one, else its own, else its EOS, written into the model's config, which is where a sequence
classifier looks for the padding that ends a row.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def load_reward_model(model_id: str, model_init_kwargs: dict, *, trust_remote_code: bool):
    """`AutoModelForSequenceClassification.from_pretrained(model_id)` with one label and TRL's float32 default
    (:func:`~hf_verl.trainers.engine_glue.load_pretrained`); loaded whole, its engine shards it."""
    from transformers import AutoModelForSequenceClassification

    from hf_verl.trainers.engine_glue import load_pretrained

    kwargs = dict(model_init_kwargs, num_labels=1)  # the model's one output is the reward
    return load_pretrained(model_id, kwargs, trust_remote_code=trust_remote_code,
                           auto_class=AutoModelForSequenceClassification)


def check_reward_model(model: Any) -> None:
    """A model object must score with one output (TRL's check, with its words)."""
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    if labels != 1:
        raise ValueError(f"The model has `num_labels={labels}`, but reward models require `num_labels=1`: one scalar "
                         "reward per sequence. Build it with num_labels=1 (e.g. AutoModelForSequenceClassification."
                         "from_pretrained(name, num_labels=1)), or pass the model's name as a string.")


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def set_eos_token(model: Any, tokenizer: Any, eos_token: str) -> None:
    """Make `eos_token` the tokenizer's EOS, and the model config's."""
    if eos_token not in tokenizer.get_vocab():
        raise ValueError(f"eos_token {eos_token!r} is not in the vocabulary of the {type(tokenizer).__name__}; pick "
                         "one of its tokens or leave eos_token unset.")
    tokenizer.eos_token = eos_token
    _text_config(model).eos_token_id = tokenizer.eos_token_id


def take_chat_template(model: Any, tokenizer: Any, path: str, *, trust_remote_code: bool = False) -> list[int]:
    """Give `tokenizer` the chat template at `path`: a Jinja file's text as it is (the tokens it names must exist
    already), or another tokenizer's template (a local path or Hub id), which brings its added tokens that this
    tokenizer lacks and its EOS token; the model's embeddings are then resized to the vocabulary.

    Returns:
        `list[int]`: the ids of the tokens added (to train with PEFT, make them trainable).
    """
    if os.path.isfile(path) and path.endswith((".jinja", ".j2")):
        with open(path, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
        return []
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    template = source.get_chat_template()
    vocab = tokenizer.get_vocab()
    new = [token for token in source.added_tokens_decoder.values() if token.content not in vocab]
    tokenizer.add_tokens(new)
    tokenizer.chat_template = template
    if source.eos_token is not None:
        tokenizer.eos_token = source.eos_token
        _text_config(model).eos_token_id = tokenizer.eos_token_id
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    added = [tokenizer.convert_tokens_to_ids(token.content) for token in new]
    logger.info("chat template taken from %s (%d token(s) added, EOS %r)", path, len(added), tokenizer.eos_token)
    return added


def set_pad_token(model: Any, tokenizer: Any, pad_token: str | None) -> None:
    """The padding token: `pad_token`, else the tokenizer's, else its EOS; checked against the vocabulary and
    written into the model's config (a sequence classifier reads each row's score before the padding starts)."""
    pad = pad_token or tokenizer.pad_token or tokenizer.eos_token
    if pad is None or pad not in tokenizer.get_vocab():
        raise ValueError(f"the padding token {pad!r} is not in the vocabulary of the {type(tokenizer).__name__}: set "
                         "tokenizer.pad_token (or eos_token) to one of its tokens.")
    tokenizer.pad_token = pad
    _text_config(model).pad_token_id = tokenizer.pad_token_id


def warn_if_head_frozen(peft_config: Any) -> None:
    """With adapters on a model whose `score` head is new (a causal LM loaded with one label), the head stays at its
    random initialisation unless PEFT trains it: say so once (TRL recommends `modules_to_save=["score"]`)."""
    task = str(getattr(getattr(peft_config, "task_type", None), "value", getattr(peft_config, "task_type", "")))
    saved = getattr(peft_config, "modules_to_save", None) or []
    targets = getattr(peft_config, "target_modules", None) or []
    if task != "SEQ_CLS" and "score" not in saved and "score" not in targets:
        logger.warning("peft_config trains adapters only: the `score` head keeps its initial weights. For a model "
                       "without a trained head (a causal LM loaded with num_labels=1) add modules_to_save=['score'] "
                       "or task_type='SEQ_CLS' to the peft config.")
