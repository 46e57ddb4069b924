"""What the planner knows of a model: its shape (:class:`Architecture`), from a module, a config, a Hub id / path
(the config only, offline) or a size string.

A size string ("7b", "70B", "0.5b") means one stated reference architecture from :data:`REFERENCE_ARCHITECTURES`
(public configs, quoted below); any other count ("20b", 3_000_000_000) is the nearest reference with its layer count
scaled to it, which the :attr:`Architecture.source` says.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Architecture", "REFERENCE_ARCHITECTURES", "resolve_architecture", "parse_size", "whole_numel"]


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer's shape: what memory and step time depend on.

    Args:
        hidden (`int`): hidden size. layers (`int`): decoder layers. heads (`int`): query heads.
        kv_heads (`int`): key-value heads (GQA). intermediate (`int`): MLP width (gated: gate, up, down).
        vocab (`int`): vocabulary size. tied (`bool`): input and output embeddings shared.
        qkv_bias (`bool`): biases on q / k / v (Qwen2). head_dim (`int`, *optional*): default hidden // heads.
        source (`str`): where the shape came from, quoted in explanations.
        num_params (`int`, *optional*): the exact count when a module was given.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    head_dim: int | None = None
    source: str = ""
    num_params: int | None = None

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_head

    @property
    def q_dim(self) -> int:
        return self.heads * self.dim_head

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, gated MLP, two RMSNorms."""
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head (once when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        """All parameters (the exact count of a given module, else the formula)."""
        if self.num_params is not None:
            return self.num_params
        return self.layers * self.layer_params + self.embedding_params + self.hidden


def _ref(hidden, layers, heads, kv, inter, vocab, tied, bias, source) -> Architecture:
    return Architecture(hidden, layers, heads, kv, inter, vocab, tied, bias, source=source)


# size string -> a public architecture (numbers from the models' config.json)
REFERENCE_ARCHITECTURES: dict[str, Architecture] = {
    "0.5b": _ref(896, 24, 14, 2, 4864, 151936, True, True, "Qwen2.5-0.5B's architecture"),
    "1.5b": _ref(1536, 28, 12, 2, 8960, 151936, True, True, "Qwen2.5-1.5B's architecture"),
    "3b": _ref(2048, 36, 16, 2, 11008, 151936, True, True, "Qwen2.5-3B's architecture"),
    "7b": _ref(4096, 32, 32, 32, 11008, 32000, False, False, "Llama-2-7B's architecture"),
    "8b": _ref(4096, 32, 32, 8, 14336, 128256, False, False, "Llama-3-8B's architecture"),
    "13b": _ref(5120, 40, 40, 40, 13824, 32000, False, False, "Llama-2-13B's architecture"),
    "32b": _ref(5120, 64, 40, 8, 27648, 152064, False, True, "Qwen2.5-32B's architecture"),
    "70b": _ref(8192, 80, 64, 8, 28672, 32000, False, False, "Llama-2-70B's architecture"),
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMBT]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_size(size: int | str) -> tuple[str | None, int]:
    """`("7b", 7_000_000_000)` for "7B"; the key is `None` when no reference architecture has that name.

    Raises:
        `ValueError`: not a count or a string like "7b" / "500M".
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return None, size
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"model size {size!r} is not a parameter count: write e.g. '7b', '500M' or 7_000_000_000.")
    number, unit = match.groups()
    key = f"{float(number):g}{unit.lower()}"
    return (key if key in REFERENCE_ARCHITECTURES else None), int(float(number) * _SCALE[unit.lower()])


def _from_size(size: int | str) -> Architecture:
    key, count = parse_size(size)
    if key is not None:
        return REFERENCE_ARCHITECTURES[key]
    # the reference with the nearest count, deepened / made shallower to the asked count (its heads stay valid)
    base = min(REFERENCE_ARCHITECTURES.values(), key=lambda a: abs(math.log(a.params / count)))
    layers = max(1, round((count - base.embedding_params) / base.layer_params))
    arch = replace(base, layers=layers)
    return replace(arch, source=f"{size} parameters: {base.source} with {layers} layers "
                                f"({arch.params / 1e9:.2f}B parameters)")


def from_config(config: Any, source: str = "", num_params: int | None = None) -> Architecture:
    """The :class:`Architecture` of a transformers `PretrainedConfig` (decoder-only LMs; a composite config's text
    part is used).

    Raises:
        `ValueError`: the config lacks a decoder's shape fields.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        hidden, layers, heads = text.hidden_size, text.num_hidden_layers, text.num_attention_heads
    except AttributeError as err:
        raise ValueError(f"{type(config).__name__} has no decoder shape (hidden_size, num_hidden_layers, "
                         "num_attention_heads): pass a causal-LM config, a model, or a size string like '7b'.") from err
    kv = getattr(text, "num_key_value_heads", None) or heads
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    return Architecture(hidden, layers, heads, kv, inter, text.vocab_size,
                        tied=bool(getattr(text, "tie_word_embeddings", False)),
                        qkv_bias=bool(getattr(text, "attention_bias", False) or "qwen2" in str(getattr(text, "model_type", ""))),
                        head_dim=getattr(text, "head_dim", None), source=source or f"{type(config).__name__}",
                        num_params=num_params)


def whole_numel(p: Any) -> int:
    """A parameter's whole element count: a ZeRO-3 partitioned parameter is empty on every rank (`ds_numel` keeps
    its count); FSDP2's DTensor and a meta parameter count as a whole one already."""
    return int(getattr(p, "ds_numel", None) or p.numel())


def resolve_architecture(model: Any) -> Architecture:
    """An :class:`Architecture` from a module, a config, a Hub id / local path (its config only, never the
    weights, offline: the local Hub cache) or a size string / parameter count.

    Raises:
        `ValueError`: a string that is neither a size nor a resolvable config, naming both readings.
    """
    if isinstance(model, Architecture):
        return model
    if hasattr(model, "parameters") and hasattr(model, "config"):
        count = sum(whole_numel(p) for p in model.parameters())
        base = getattr(model, "base_model", model)
        config = getattr(getattr(base, "model", base), "config", model.config)
        return from_config(config, source=f"the given {type(model).__name__} ({count / 1e6:.1f}M parameters)",
                           num_params=count)
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        return from_config(model, source=f"the given {type(model).__name__}")
    if isinstance(model, int) or (isinstance(model, str) and _SIZE.match(model)):
        return _from_size(model)
    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read a config for {model!r} offline ({err}); pass a size string such as '7b', "
                             "a PretrainedConfig, or a local model directory.") from err
        return from_config(config, source=f"{model}'s config")
    raise ValueError(f"cannot tell a model's shape from a {type(model).__name__}: pass an nn.Module, a "
                     "PretrainedConfig, a Hub id / path, or a size string like '7b'.")
