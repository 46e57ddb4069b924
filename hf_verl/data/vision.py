"""Vision-language rows: TRL's image dataset formats, the construction checks, and each row's pixel inputs.

TRL 1.16's formats: an `image` column (one image per row) or an `images` column (a list per row) beside a
*conversational* `prompt`; the images go into the first user turn as `{"type": "image"}` parts (TRL's
`prepare_multimodal_messages`), or the prompt's messages already hold `{"type": "image", "image": ...}` parts. The
`processing_class` is the model's processor (an `AutoProcessor`: a tokenizer and an image processor); its
`apply_chat_template` renders and tokenises a row and returns the model's pixel inputs beside the ids.

A row's pixel inputs travel with it as one dict of tensors (:func:`tokenize_vision_prompts`, kept in
`RolloutBatch.meta[VISION_INPUTS]`, so that selecting rows selects them) and are laid out for a forward by
:func:`collate_vision_inputs`: per-image fields (`pixel_values`, `image_grid_thw`, `pixel_attention_mask`, ...) are
concatenated over the rows (zero-padded on the images dim of a family that keeps a row's images there, Idefics3);
per-token fields (`token_type_ids`, `mm_token_type_ids`) are placed under the row's left-padded prompt and zero
elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_verl.data.prompts import TokenizedPrompts, is_conversational

IMAGE_COLUMNS = ("image", "images")
VISION_INPUTS = "vision_inputs"  # the RolloutBatch.meta key of each row's pixel inputs
PER_TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")  # (1, prompt length) fields of a processor's output


def image_columns(dataset: Any) -> list[str]:
    """The image columns (`image`, `images`) of a dataset (none for a dataset without column names)."""
    return sorted(set(IMAGE_COLUMNS) & set(getattr(dataset, "column_names", None) or []))


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer of a processor (its `tokenizer`), or `processing_class` itself when it is a tokenizer. A
    processor's tokenizer without a chat template is given the processor's (where processors keep it), so that
    text-only rows render as the processor renders them."""
    inner = getattr(processing_class, "tokenizer", None)
    if inner is None or not hasattr(processing_class, "apply_chat_template"):
        return processing_class
    if getattr(inner, "chat_template", None) is None and getattr(processing_class, "chat_template", None):
        inner.chat_template = processing_class.chat_template
    return inner


def is_vision_model(model: Any) -> bool:
    """Whether `model` (a transformers model, PEFT-wrapped or not) has a vision tower: its config has a
    `vision_config`."""
    config = getattr(model, "config", None)
    return getattr(config, "vision_config", None) is not None


def check_vision_setup(model: Any, processing_class: Any, datasets: Sequence[Any], *, trainer: str) -> bool:
    """Refuse, at construction, image columns a run cannot use; return whether the run trains on images.

    Raises:
        ValueError: an image column with a text-only model, or with a `processing_class` that has no image
            processor (a tokenizer where the model's `AutoProcessor` is needed).
    """
    columns = sorted({c for ds in datasets if ds is not None for c in image_columns(ds)})
    if not columns:
        return False
    check_vision_inputs(model, processing_class, columns, trainer=trainer)
    return True


def check_vision_inputs(model: Any, processing_class: Any, columns: Sequence[str], *, trainer: str) -> None:
    """:func:`check_vision_setup` for rows whose image `columns` are known (the facade's rows)."""
    if not is_vision_model(model):
        name = type(getattr(model, "get_base_model", lambda: model)()).__name__
        raise ValueError(f"{trainer}: the dataset appears to be vision-related (it has image column(s) {columns}) but "
                         f"the model ({name}) is text-only (its config has no vision_config), not a vision-language "
                         "model. Train a vision-language model (Qwen2-VL, Gemma 3, LLaVA, ...) or drop the column(s) "
                         "(dataset.remove_columns).")
    if getattr(processing_class, "image_processor", None) is None:
        raise ValueError(f"{trainer}: the dataset has image column(s) {columns} but processing_class "
                         f"({type(processing_class).__name__}) has no image processor. Pass the model's processor: "
                         "processing_class=AutoProcessor.from_pretrained(<model>).")


def row_images(row: Mapping) -> list | None:
    """A row's images as TRL reads them: its `images` list, or `[image]`; None without."""
    if "images" in row:
        images = row.get("images")
        return list(images) if images else None
    image = row.get("image")
    return None if image is None else [image]


def prepare_multimodal_messages(messages: Sequence[Mapping], images: Sequence | None) -> list[dict]:
    """TRL's conversion of a conversational prompt with `images`: string contents become text parts, and the images
    go into the first user turn as image parts before its text; messages that already hold image parts keep them
    (their unfilled placeholders are filled from `images`, in order).

    Raises:
        ValueError: more or fewer placeholders than images.
    """
    images = list(images or [])
    structured = any(isinstance(m.get("content"), list) for m in messages)
    out, placed = [], False
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "image" and part.get("image") is None:
                    if not images:
                        raise ValueError("the prompt has more image placeholders than the row has images.")
                    part = {**part, "image": images.pop(0)}
                parts.append(dict(part))
        else:
            parts = [] if content is None else [{"type": "text", "text": content}]
            if not structured and not placed and m.get("role") == "user" and images:
                parts = [{"type": "image", "image": img} for img in images] + parts
                images, placed = [], True
        out.append({**m, "content": parts})
    if images:
        raise ValueError(f"{len(images)} image(s) of the row have no place in its prompt: give a user turn, or as "
                         "many {'type': 'image'} parts as images.")
    return out


@dataclass
class VisionPrompts(TokenizedPrompts):
    """Tokenised prompts with images: besides the texts and ids, each row's pixel inputs."""

    vision_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)


def tokenize_vision_prompts(rows: Sequence[Mapping], processor: Any, max_prompt_length: int | None,
                            chat_template_kwargs: dict | None = None) -> VisionPrompts:
    """Render and tokenise each row's conversational prompt with its images through `processor`.

    Returns:
        [`VisionPrompts`]: per row, the prompt as text (image placeholders unexpanded), its token
        ids (image tokens expanded by the processor) and its pixel inputs (every processor output besides
        `input_ids` / `attention_mask`, per-token fields as `(prompt length,)`).

    Raises:
        ValueError: a prompt that is not conversational (TRL's rule: the processor applies the chat template), or
            longer than `max_prompt_length` (cutting it would cut its image tokens off their pixels).
    """
    texts, ids, inputs = [], [], []
    previous = None  # (prompt, image key) of the last row: a GRPO group repeats its row, processed once
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        key = (prompt, _image_key(row_images(row)))
        if previous is not None and key == previous:
            texts.append(texts[-1])
            ids.append(ids[-1])
            inputs.append(inputs[-1])
            continue
        previous = key
        if not is_conversational(prompt):
            raise ValueError(f"prompt {i}: training on images needs conversational prompts (a list of "
                             "{'role', 'content'} messages), as in TRL: pass the raw messages and let the trainer "
                             "apply the chat template.")
        messages = prepare_multimodal_messages(prompt, row_images(row))
        out = processor.apply_chat_template([messages], add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="pt", **(chat_template_kwargs or {}))
        row_ids = [int(t) for t in out["input_ids"][0]]
        if max_prompt_length is not None and len(row_ids) > max_prompt_length:
            raise ValueError(f"prompt {i} has {len(row_ids)} tokens with its image tokens, more than "
                             f"max_prompt_length={max_prompt_length}; image prompts are not truncated (the image "
                             "tokens would lose their pixels): raise max_prompt_length or set it to None.")
        fields = {}
        for key, value in out.items():
            if key in ("input_ids", "attention_mask"):
                continue
            value = torch.as_tensor(value)
            fields[key] = value[0] if key in PER_TOKEN_FIELDS else value
        texts.append(processor.apply_chat_template([messages], add_generation_prompt=True, tokenize=False,
                                                   **(chat_template_kwargs or {}))[0])
        ids.append(row_ids)
        inputs.append(fields)
    return VisionPrompts(texts, ids, 0, inputs)


def _image_key(images: Sequence | None) -> tuple:
    """What identifies a row's images for reuse: each image's size, mode and pixels (its identity if not PIL)."""
    return tuple((getattr(im, "size", None), getattr(im, "mode", None),
                  im.tobytes() if callable(getattr(im, "tobytes", None)) else id(im)) for im in images or ())


def collate_vision_inputs(inputs: Sequence[Mapping[str, torch.Tensor]], *, prompt_width: int, width: int,
                          device: torch.device | str, right_padded: bool = False) -> dict[str, torch.Tensor]:
    """The model's keyword inputs for rows laid out as a left-padded prompt of `prompt_width` (each row's prompt
    ending at `prompt_width`) followed by `width - prompt_width` completion positions; with `right_padded`, rows of
    `width` positions that each start with their prompt (DPO's pair rows).

    Rows without images (a text-only row beside image rows) add nothing to the per-image fields, whose images the
    model matches to the image tokens in order, and zeros to the per-token ones.
    """
    keys = list(dict.fromkeys(k for x in inputs for k in x))
    out = {}
    for key in keys:
        have = [x[key] for x in inputs if key in x]
        if key in PER_TOKEN_FIELDS:
            laid = torch.zeros((len(inputs), width), dtype=have[0].dtype)
            for i, x in enumerate(inputs):
                if key not in x:
                    continue
                n = x[key].shape[0]
                start = 0 if right_padded else prompt_width - n
                laid[i, start : start + n] = x[key]
            out[key] = laid.to(device)
        else:
            out[key] = torch.cat(_pad_images_dim(have)).to(device)
    return out


def _pad_images_dim(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-row tensors of a per-image field, zero-padded on dim 1 where only that dim differs: fields that hold a
    row's images on dim 1 (Idefics3's `(1, images, 3, H, W)` pixels and their pixel mask) for rows with different
    numbers of images, padded with all-zero images as the family's processor pads a batch (the model skips them)."""
    shapes = {tuple(t.shape[2:]) for t in tensors}
    widths = {t.shape[1] for t in tensors if t.dim() > 1}
    if len(widths) < 2 or len(shapes) > 1 or any(t.dim() < 3 for t in tensors):
        return list(tensors)
    most = max(widths)
    return [torch.cat([t, t.new_zeros((t.shape[0], most - t.shape[1], *t.shape[2:]))], dim=1) for t in tensors]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_vision_pair(row: Mapping, processor: Any, max_length: int | None, index: int = 0) -> dict:
    """DPO's token columns of a preference row with images: the prompt rendered with its images by `processor`
    (image tokens expanded), and the chosen / rejected answers as the tokens after it in prompt + answer
    (conversational rows: TRL's VLM format). `max_length` cuts the answers' ends (keep_start); a prompt is never cut:
    a row whose prompt alone fills `max_length` gets empty answers, and DPO drops it with a warning (as TRL drops it).

    Raises:
        ValueError: a row that is not conversational.
    """
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if not (is_conversational(prompt) and is_conversational(chosen) and is_conversational(rejected)):
        raise ValueError(f"row {index}: preference pairs with images need conversational prompt, chosen and "
                         "rejected columns (lists of {'role', 'content'} messages), as in TRL.")
    messages = prepare_multimodal_messages(prompt, row_images(row))

    def ids(conversation, generation_prompt):
        out = processor.apply_chat_template([conversation], add_generation_prompt=generation_prompt, tokenize=True,
                                            return_dict=True, return_tensors="pt")
        return [int(t) for t in out["input_ids"][0]]

    p = ids(messages, True)
    pc = ids(messages + prepare_multimodal_messages(chosen, None), False)
    pr = ids(messages + prepare_multimodal_messages(rejected, None), False)
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    chosen_ids, rejected_ids, truncated = pc[n:], pr[n:], False
    if max_length is not None and n + max(len(chosen_ids), len(rejected_ids)) > max_length:
        room = max(max_length - n, 0)
        chosen_ids, rejected_ids, truncated = chosen_ids[:room], rejected_ids[:room], True
    return {"prompt_ids": p[:n], "chosen_ids": chosen_ids, "rejected_ids": rejected_ids, "truncated": truncated,
            "identical": chosen_ids == rejected_ids}


@dataclass
class VisionPreferenceCollator:
    """DPO's pair batches (:class:`~hf_verl.data.preference.PreferenceCollator`, padded) with each sequence's pixel
    inputs under `VISION_INPUTS` (chosen rows, then rejected rows: a pair's two sequences share its images)."""

    processor: Any
    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: Sequence[dict]) -> dict:
        from hf_verl.data.preference import PreferenceCollator

        batch = PreferenceCollator(self.pad_token_id, False, self.pad_to_multiple_of)(rows)
        inputs = tokenize_vision_prompts(rows, self.processor, None).vision_inputs
        batch[VISION_INPUTS] = inputs + inputs
        return batch
