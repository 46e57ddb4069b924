"""Tiny vision-language models and their processors, built in code (no Hub): a character-level tokenizer with the
family's image tokens and a chat template that renders image parts, the family's PIL image processor at a small
image size, and a 2-layer text model beside a 2-layer vision tower.

The Qwen2-VL / Qwen2.5-VL processors are built without their video processor (:func:`without_video_processor`):
transformers has no video processor class without torchvision, and no torchvision imports beside the pinned CPU
torch here (docs/vlm.md). SmolVLM is not built: its processor's `apply_chat_template` reads its video processor's
frame settings on every call.
"""

from __future__ import annotations

import numpy as np
import torch

SPECIALS = ["<pad>", "<eos>", "<user>", "<assistant>", "<system>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:=+-\n")

# a chat template whose messages hold either a string or a list of {"type": "text" | "image"} parts (TRL's
# conversational VLM format); `image` renders the family's image placeholder
VLM_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_vlm_tokenizer(image_tokens: dict[str, str]):
    """A character-level tokenizer whose vocabulary also holds `image_tokens` (attribute name -> token text,
    e.g. `{"boi_token": "<start_of_image>"}`), each exposed as `tokenizer.<name>` / `<name>_id`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra = list(dict.fromkeys(image_tokens.values()))
    vocab = {t: i for i, t in enumerate(SPECIALS + extra + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   extra_special_tokens=dict(image_tokens))
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[2:] + extra})
    return fast


def random_image(seed: int, size: int = 32):
    """A reproducible RGB PIL image of noise."""
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


def build_gemma3(seed: int = 0):
    """A tiny Gemma 3 (text hidden 64, SigLIP tower at 28x28 pixels, 4 image tokens) and its `Gemma3Processor`."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    tok = build_vlm_tokenizer({"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                               "eoi_token": "<end_of_image>"})
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=4,
                                chat_template=VLM_TEMPLATE.replace("IMAGE", "<start_of_image>"))
    config = Gemma3Config(
        text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 256, "sliding_window": 64,
                     "layer_types": ["sliding_attention", "full_attention"]},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 28, "patch_size": 14, "vision_use_head": False},
        mm_tokens_per_image=4, boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    # transformers initialises the image projection to zeros (a fresh model's text would not see the image)
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, processor


def build_llava(seed: int = 0, vision_feature_layer: int = -1):
    """A tiny LLaVA (a Llama text model, hidden 64, beside a CLIP tower at 28x28 pixels: 4 image tokens) and its
    `LlavaProcessor` (CLIP's PIL image processor). By default the tower's last layer feeds the projector; its
    `post_layernorm` serves the pooled output only and gets no gradient (with `vision_feature_layer=-2`, as TRL's
    tiny LLaVA, neither does the last layer)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = build_vlm_tokenizer({"image_token": "<image>"})
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=VLM_TEMPLATE.replace("IMAGE", "<image>"))
    config = LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 256, "pad_token_id": tok.pad_token_id,
                     "eos_token_id": tok.eos_token_id},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 28, "patch_size": 14,
                       "projection_dim": 32},
        image_token_index=tok.image_token_id, vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy="default",
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, processor


def without_video_processor(processor_class: type) -> type:
    """`processor_class` (a processor whose constructor takes `image_processor, tokenizer, video_processor`:
    Qwen2-VL, Qwen2.5-VL) as a subclass whose constructor takes no video processor.

    transformers' `ProcessorMixin` takes a processor's sub-processors from its constructor's signature and types
    each one; without torchvision transformers has no video processor class at all (`VideoProcessorMixin` needs
    it), so the processor cannot be built even for images. Every image path (`__call__`, `apply_chat_template`,
    the image-token expansion) is the parent's own code; `ProcessorMixin.__call__` skips videos when the processor
    has no `video_processor` (the parent's constructor passes its `None` video processor on, and the mixin, reading
    this subclass's signature, takes two sub-processors). The class is named `<parent>WithoutVideo`, so that a saved
    processor does not claim to be the parent (whose loading needs torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(f"{processor_class.__name__}WithoutVideo", (processor_class,),
                {"__init__": __init__, "__module__": __name__})


QWEN_IMAGE_TOKENS = {"vision_start_token": "<|vision_start|>", "image_token": "<|image_pad|>",
                     "vision_end_token": "<|vision_end|>", "video_token": "<|video_pad|>"}


def _qwen_processor(processor_class: type, tokenizer=None, chat_template: str | None = None):
    """A Qwen-VL processor (`processor_class` without its video processor) over the character-level tokenizer (or
    `tokenizer`, which must have Qwen's vision tokens as `image_token`, ... attributes, and its `chat_template`),
    with Qwen2-VL's PIL image processor at 56x56 pixels (a 4x4 patch grid: 4 image tokens after the 2x2 merge)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = tokenizer if tokenizer is not None else build_vlm_tokenizer(QWEN_IMAGE_TOKENS)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    return without_video_processor(processor_class)(
        image_processor=image_processor, tokenizer=tok,
        chat_template=chat_template or VLM_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>"))


def _qwen_text_config(tok) -> dict:
    return {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": tok.eos_token_id, "eos_token_id": tok.eos_token_id}


def _qwen_token_ids(tok) -> dict:
    return {"image_token_id": tok.image_token_id, "video_token_id": tok.video_token_id,
            "vision_start_token_id": tok.vision_start_token_id, "vision_end_token_id": tok.vision_end_token_id,
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}


def _finish(model, tok):
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def build_qwen2_vl(seed: int = 0, tokenizer=None, chat_template: str | None = None):
    """A tiny Qwen2-VL (text hidden 64 with multimodal RoPE sections [2, 3, 3], a 2-layer vision tower) and its
    `Qwen2VLProcessor` (without its video processor: :func:`without_video_processor`); `tokenizer` and
    `chat_template` replace the character-level ones (:func:`_qwen_processor`)."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
    )

    processor = _qwen_processor(Qwen2VLProcessor, tokenizer, chat_template)
    tok = processor.tokenizer
    config = Qwen2VLConfig(
        text_config=_qwen_text_config(tok),
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        **_qwen_token_ids(tok))
    torch.manual_seed(seed)
    return _finish(Qwen2VLForConditionalGeneration(config), tok), processor


def build_qwen2_5_vl(seed: int = 0, tokenizer=None, chat_template: str | None = None):
    """A tiny Qwen2.5-VL (Qwen2-VL's text model; a 2-layer windowed vision tower, the first layer windowed, the
    second full) and its `Qwen2_5_VLProcessor` (without its video processor)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )

    processor = _qwen_processor(Qwen2_5_VLProcessor, tokenizer, chat_template)
    tok = processor.tokenizer
    config = Qwen2_5_VLConfig(
        text_config=_qwen_text_config(tok),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        **_qwen_token_ids(tok))
    torch.manual_seed(seed)
    return _finish(Qwen2_5_VLForConditionalGeneration(config), tok), processor


IDEFICS_IMAGE_TOKENS = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                        "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}


def _idefics_config(config_class, tok):
    """An Idefics3 config: a Llama text model (hidden 64) beside a SigLIP-like tower at 56x56 pixels
    (4x4 patches; pixel shuffle by 2: 4 image tokens)."""
    return config_class(
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 256, "pad_token_id": tok.pad_token_id,
                     "eos_token_id": tok.eos_token_id},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 56, "patch_size": 14},
        scale_factor=2, image_token_id=tok.image_token_id, pad_token_id=tok.pad_token_id)


def build_idefics3(seed: int = 0):
    """A tiny Idefics3 and its `Idefics3Processor` (Idefics3's PIL image processor, one 56x56 image without
    splitting: `<fake_token_around_image><global-img>` + 4 `<image>` tokens + `<fake_token_around_image>`)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tok = build_vlm_tokenizer(IDEFICS_IMAGE_TOKENS)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 56},
                                                do_image_splitting=False)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                                  chat_template=VLM_TEMPLATE.replace("IMAGE", "<image>"))
    torch.manual_seed(seed)
    return _finish(Idefics3ForConditionalGeneration(_idefics_config(Idefics3Config, tok)), tok), processor



def register_processors_without_video() -> None:
    """Register the Qwen2-VL / Qwen2.5-VL processors without their video processor (:func:`without_video_processor`)
    with `AutoProcessor`, so that one saved by :func:`build_qwen2_vl` / :func:`build_qwen2_5_vl` loads by
    `AutoProcessor.from_pretrained` (the TRL-suite harness's offline hub: TRL's tests load processors by id)."""
    from transformers import (
        AutoProcessor,
        Qwen2_5_VLConfig,
        Qwen2_5_VLProcessor,
        Qwen2VLConfig,
        Qwen2VLProcessor,
    )

    for config_class, processor_class in ((Qwen2VLConfig, Qwen2VLProcessor), (Qwen2_5_VLConfig, Qwen2_5_VLProcessor)):
        AutoProcessor.register(config_class, without_video_processor(processor_class), exist_ok=True)
