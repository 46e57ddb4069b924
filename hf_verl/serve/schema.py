"""Request models of the rollout server (pydantic): OpenAI's completions and chat completions, as vLLM takes them.

Fields hf_verl cannot honour are refused by name (`suffix`, `logit_bias`, penalties other than the repetition
penalty, `tools`, non-text content, `echo` / `prompt_logprobs` with `stream`), rather than silently ignored; unknown fields are ignored, as
vLLM does (clients send extras such as vLLM's `return_token_ids`). The caps on `n`, `max_tokens` and prompts
per request are the server's, checked by the server. These models also make the OpenAPI page (`/docs`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from hf_verl.rollout.base import SamplingParams


def _check_prompt(value: Any) -> Any:
    """Text, token ids, or a non-empty list of either, normalised to a list of prompts."""
    def is_ids(item) -> bool:
        return isinstance(item, list) and bool(item) and all(type(t) is int and t >= 0 for t in item)

    if value is None or (isinstance(value, (str, list)) and len(value) == 0):
        raise ValueError("a prompt is required: text, token ids, or a list of either")
    if isinstance(value, str) or is_ids(value):
        return [value]
    if not isinstance(value, list):
        raise ValueError("prompt must be text, token ids, or a list of either")  # noqa: TRY004 (pydantic's kind)
    for item in value:
        if not ((isinstance(item, str) and item) or is_ids(item)):
            raise ValueError(f"each prompt must be non-empty text or a non-empty list of token ids >= 0, not "
                             f"{item!r:.60}")
    return value


Prompt = Annotated[str | list[int] | list[str | list[int]], BeforeValidator(_check_prompt)]


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and empty `choices`).")
    continuous_usage_stats: bool = Field(False, description="Put the usage so far in every chunk (vLLM).")


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share: model, sampling, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="A served model name (`GET /v1/models`); others are a 404.")
    max_tokens: int | None = Field(None, ge=1, description="New tokens per choice, at most the server's cap.")
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 disables it.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    stop: str | list[str] | None = Field(None, description="Strings that end a choice (kept in its text).")
    n: int = Field(1, ge=1, description="Choices per prompt, at most the server's cap.")
    seed: int | None = Field(None, description="A seeded request is generated alone, reproducibly.")
    stream: bool = Field(False, description="Answer as server-sent events, a chunk per generated token.")
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(0.0, description="Not supported: must be 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported.")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or ())
        if any(not s for s in stops) or len(stops) > 16:
            raise ValueError("stop must be up to 16 non-empty strings")
        return value

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "suffix", check_fields=False)
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            hint = "; use repetition_penalty" if info.field_name.endswith("_penalty") else ""
            raise ValueError(f"{info.field_name} is not supported by hf-verl serve{hint}")
        return value

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        """These fields as the engine's [`SamplingParams`]."""
        stop = self.stop
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty,
                              stop=tuple([stop] if isinstance(stop, str) else (stop or ())), seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`."""

    prompt: Prompt = Field(description="Text, token ids, or a list of either (one choice group per prompt).")
    max_tokens: int | None = Field(16, ge=0, description="New tokens per choice (16), at most the server's cap; 0 "
                                                         "(with `echo`) only scores the prompt.")
    logprobs: int | None = Field(None, ge=0, le=20, description="Accepted; every choice carries its sampled "
                                                               "tokens' log-probs (no alternatives).")
    echo: bool = Field(False, description="Put the prompt before the completion in `text` and its tokens' log-probs "
                                          "(the first one null) before the sampled ones in `logprobs`.")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM's: each choice gets `prompt_logprobs`, "
                                        "per prompt token its log-prob and rank and the K most likely tokens'.")
    return_routed_experts: bool = Field(False, description="hf_verl's (vLLM's `enable_return_routed_experts`, per "
                                        "request here): each choice gets `routed_experts`, for every token of prompt "
                                        "and completion the experts each Mixture-of-Experts layer routed it to "
                                        "(`[tokens][layers][top_k]`, -1: no forward routed it); an MoE model served by "
                                        "the transformers engine.")
    return_token_weight_versions: bool = Field(False, description="hf_verl's: each choice gets "
                                               "`token_weight_versions`, the weight version behind each completion "
                                               "token (weights updated in flight change it mid-completion).")
    suffix: str | None = Field(None, description="Not supported.")
    best_of: int | None = Field(None, description="Not supported beyond `n`.")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value, info):
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported by hf-verl serve")
        return value

    @model_validator(mode="after")
    def _scoring(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: it is allowed only with echo=true (score the prompt)")
        if self.stream and self.return_routed_experts:
            raise ValueError("return_routed_experts is not supported with stream=true by hf-verl serve; send the "
                             "request without stream")
        if self.stream and self.scores_prompt:
            raise ValueError("echo and prompt_logprobs are not supported with stream=true by hf-verl serve; send "
                             "the request without stream")
        return self

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's log-probs are asked for (`echo` or `prompt_logprobs`)."""
        return self.echo or self.prompt_logprobs is not None

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt


class TextPart(BaseModel):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str


class ChatMessage(BaseModel):
    """One turn; keys beyond these are handed to the chat template as they are."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in value):
            raise ValueError("content must be text or a list of {'type': 'text', 'text': ...} parts; hf-verl serve "
                             "takes no images or other parts")
        return value

    def for_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`: the messages go through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of `max_tokens`.")
    logprobs: bool = Field(False, description="Return each sampled token's log-prob (no alternatives).")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Accepted; alternatives are not returned.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="More variables for the template.")
    tools: list[dict] | None = Field(None, description="Not supported.")
    tool_choice: Any = Field(None, description="Not supported.")
    response_format: dict | None = Field(None, description="Only {'type': 'text'}.")

    @field_validator("tools", "tool_choice")
    @classmethod
    def _no_tools(cls, value, info):
        if value not in (None, "none", []):
            raise ValueError(f"{info.field_name} is not supported: hf-verl serve does not parse tool calls; "
                             "render the tools into a prompt and use /v1/completions")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value and value.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported by hf-verl serve")
        return value


class WeightPath(BaseModel):
    """`POST /v1/weights` with a JSON body: load a safetensors file, or every one in a folder."""

    path: str = Field(description="A .safetensors file or a folder of them, readable by the server.")


class ClassifyRequest(BaseModel):
    """`POST /classify` (also `/v1/classify`): vLLM's classification request (completion form), so that a
    client scores through either server. A reward model (`num_labels=1`) is read with `use_activation=false`
    (the raw logit, the reward); the default applies vLLM's activation (sigmoid for one label, else softmax)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="A served model name (`GET /v1/models`); others are a 404.")
    input: Prompt = Field(description="Text, token ids, or a list of either (one result per input).")
    use_activation: bool | None = Field(None, description="False: raw logits in `probs`; None/True: vLLM's "
                                                          "activation (sigmoid for one label, else softmax).")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS) to text inputs.")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="Keep the last N tokens (-1: the "
                                                                        "model's context).")
    user: str | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        return self.input
