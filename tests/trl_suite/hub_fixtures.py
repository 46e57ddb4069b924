"""An offline Hugging Face Hub holding the tiny models and data sets that TRL's test files load, built in code.

TRL's tests name Hub repositories (`trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`, the `zen` data sets, ...).
This machine has no Hub, so :func:`build_hub` writes look-alikes that the real loading code resolves offline:

- models: `hub/models--ORG--NAME/snapshots/<hash>/` + `refs/main`, the layout `huggingface_hub` reads with
  `HF_HUB_OFFLINE=1` (so `from_pretrained("ORG/NAME")` goes through the real resolution code). Each model is a
  tiny config of the named architecture (hidden 8-16, 2 layers) with random weights saved in bfloat16 like TRL's,
  and a byte-level BPE tokenizer trained here, carrying the special tokens and the chat template of its family
  (the templates TRL ships in `trl/chat_templates/`, read from the installed trl).
- data sets: `datasets/ORG___NAME/<config>/0.0.0/<hash>/` (arrow + `dataset_info.json`), the cache that
  `datasets.load_dataset("ORG/NAME", config)` falls back to offline (map-style and `streaming=True` alike).
  The rows are written here from the Zen of Python (`import this`), with the columns and split sizes of TRL's
  (19 rows, `train` 17 / `test` 2).

The `zen-image` data set (the conversational configs with a random image per row) and `zen-multi-image` (0-3 images
per row) are built, and the vision-language models whose processors build here (:data:`VISION_LMS`, built by
`tests/vlm_models.py`: Gemma 3, LLaVA, Idefics3, and Qwen2-VL / Qwen2.5-VL with their processors saved without a
video processor, registered with `AutoProcessor` by the conftest prelude :func:`processor_prelude`). The others
(SmolVLM, Qwen3-VL, LLaVA-NeXT, Idefics2, Gemma 4: a video processor or torchvision needed, or a layout not written
yet) are not: tests that load them fail on TRL as well and are reported as missing fixtures, not as hf_verl
failures.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import shutil
import textwrap
from pathlib import Path

ORG = "trl-internal-testing"
FIXTURES_VERSION = "1"  # part of each model's fake commit hash

# ----------------------------------------------------------------------------------------------- tokenizers
# family -> special tokens (atomic, skipped on decode), added tokens (atomic, kept), bos/eos/pad, chat template
# (a file of trl/chat_templates or an inline template)
CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL = (
    "{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- elif m['role'] == 'assistant' %}{{- m['content'] + eos_token }}{%- else %}{{- m['content'] + '\\n' }}"
    "{%- endif %}{%- endfor %}"
)
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]
FAMILIES: dict[str, dict] = {
    "qwen2_5": dict(template="qwen2_5", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=TOOL_TAGS,
                    eos="<|im_end|>", pad="<|endoftext|>", generation_eos=["<|im_end|>", "<|endoftext|>"]),
    "qwen3": dict(template="qwen3", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  added=TOOL_TAGS + ["<think>", "</think>"], eos="<|im_end|>", pad="<|endoftext|>",
                  generation_eos=["<|im_end|>", "<|endoftext|>"]),
    "llama3_2": dict(template="llama3_2", specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                     bos="<|begin_of_text|>", eos="<|eot_id|>", generation_eos=["<|end_of_text|>", "<|eom_id|>",
                                                                               "<|eot_id|>"]),
    "mistral": dict(template=MISTRAL, specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", eos="</s>",
                    unk="<unk>"),
    "gemma": dict(template="gemma", specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
                  bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", generation_eos=["<eos>", "<end_of_turn>"]),
    "cohere2": dict(template="cohere2", specials=["<PAD>", "<UNK>", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>",
                                                  "<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
                                                  "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"],
                    bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", unk="<UNK>"),
    "gptoss": dict(template="gptoss", specials=["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>",
                                                "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                                                "<|call|>"],
                   eos="<|return|>", pad="<|endoftext|>", generation_eos=["<|return|>", "<|call|>", "<|endoftext|>"]),
    "glm4moe": dict(template="glm4moe", specials=["<|endoftext|>", "[gMASK]", "<sop>", "<eop>", "<|system|>",
                                                  "<|user|>", "<|assistant|>", "<|observation|>"],
                    added=TOOL_TAGS + ["<think>", "</think>", "<arg_key>", "</arg_key>", "<arg_value>",
                                       "</arg_value>"],
                    eos="<|endoftext|>", pad="<|endoftext|>",
                    generation_eos=["<|endoftext|>", "<|user|>", "<|observation|>"]),
    "lfm2": dict(template="lfm2", specials=["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>",
                                            "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
                                            "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>",
                                            "<|tool_response_end|>"],
                 added=["<think>", "</think>"], bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>"),
    "nemotron": dict(template="nemotron_3_nano", specials=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                     added=TOOL_TAGS + ["<think>", "</think>"], bos="<s>", eos="<|im_end|>", unk="<unk>",
                     generation_eos=["<|im_end|>", "</s>"]),
    "olmo3": dict(template=CHATML, specials=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
                  eos="<|im_end|>", pad="<|pad|>"),
}
FAMILIES["lfm2_2_5"] = dict(FAMILIES["lfm2"], template="lfm2_2_5")
# Qwen2-VL / Qwen2.5-VL: ChatML whose messages hold a string or typed parts, an image part rendered as Qwen's
# vision tokens (the processor expands `<|image_pad|>` to the image's merged patches)
QWEN_VL_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}{%- if m['content'] is string %}"
    "{{- m['content'] }}{%- else %}{%- for p in m['content'] %}{%- if p['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- else %}{{- p['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
QWEN_VISION_TOKENS = {"vision_start_token": "<|vision_start|>", "image_token": "<|image_pad|>",
                      "vision_end_token": "<|vision_end|>", "video_token": "<|video_pad|>"}
FAMILIES["qwen2_vl"] = dict(template=QWEN_VL_TEMPLATE, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                                 *QWEN_VISION_TOKENS.values()],
                            eos="<|im_end|>", pad="<|endoftext|>", generation_eos=["<|im_end|>", "<|endoftext|>"])


def zen_lines() -> list[str]:
    """The 19 aphorisms of the Zen of Python, from the interpreter's own `this` module."""
    import this  # noqa: F401  (prints the Zen on first import; harmless in a build step)

    text = codecs.decode(this.s, "rot13")
    return [line.strip() for line in text.splitlines()[2:] if line.strip()]


def _corpus(family: dict) -> list[str]:
    lines = zen_lines()
    extra = ["Hi there, bye.", "yes no maybe", "What is better than ugly? Beautiful.", "You are Qwen, created by "
             "Alibaba Cloud. You are a helpful assistant.", "system user assistant tool function arguments name",
             "0123456789 + - * / = ( ) { } [ ] \" ' : ; , . ! ?", "The capital of France is Paris.",
             "Set a timer for 10 minutes. What time is it in Tokyo? The weather in Berlin is sunny."]
    template = family["template"]
    template_text = template if "{" in template else _template_text(template)
    return (lines + extra) * 4 + [template_text]


def _template_text(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def build_tokenizer(family_name: str):
    """A byte-level BPE tokenizer (about 1,000 tokens) with the special tokens and chat template of a family."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    family = FAMILIES[family_name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(family["specials"])
    tok.train_from_iterator(_corpus(family), trainers.BpeTrainer(
        vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bos = family.get("bos")
    if bos is not None:  # prepend BOS on plain encodes, as Llama / Gemma / Cohere tokenizers do
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=family["eos"], pad_token=family.get("pad"),
        unk_token=family.get("unk"))
    fast.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in (
        bos, family["eos"], family.get("pad"), family.get("unk"))]})
    if family.get("added"):
        fast.add_tokens(family["added"])
    template = family["template"]
    fast.chat_template = template if "{" in template else _template_text(template)
    return fast


# ----------------------------------------------------------------------------------------------- models
SMALL = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
# repo name -> (model_type, tokenizer family, config overrides)
CAUSAL_LMS: dict[str, tuple[str, str, dict]] = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "qwen2_5", {}),
    "tiny-Qwen3ForCausalLM": ("qwen3", "qwen3", {"head_dim": 4}),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3", dict(head_dim=4, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=16, norm_topk_prob=True)),
    "tiny-LlamaForCausalLM-3.2": ("llama", "llama3_2", {}),
    "tiny-MistralForCausalLM-0.2": ("mistral", "mistral", {}),
    "tiny-Gemma2ForCausalLM": ("gemma2", "gemma", {"head_dim": 4}),
    "tiny-Cohere2ForCausalLM": ("cohere2", "cohere2", {"logit_scale": 1.0}),
    "tiny-GptOssForCausalLM": ("gpt_oss", "gptoss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=4)),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "glm4moe", dict(moe_intermediate_size=16, head_dim=4,
                                                             n_routed_experts=4, num_experts_per_tok=2,
                                                             first_k_dense_replace=1, n_group=1, topk_group=1,
                                                             use_qk_norm=True)),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "nemotron", dict(
        layers_block_type=["mamba", "attention", "moe"], num_hidden_layers=3, mamba_num_heads=8, mamba_head_dim=4,
        mamba_n_groups=1, ssm_state_size=16, mamba_d_conv=4, mamba_expand=2, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        use_mamba_kernels=False, head_dim=4)),
    "tiny-Olmo3ForCausalLM": ("olmo3", "olmo3", {}),
    "tiny-Lfm2ForCausalLM": ("lfm2", "lfm2", dict(layer_types=["conv", "full_attention"], block_multiple_of=8)),
    "tiny-Lfm2ForCausalLM-2.5": ("lfm2", "lfm2_2_5", dict(layer_types=["conv", "full_attention"],
                                                          block_auto_adjust_ff_dim=False)),
}
SEQUENCE_CLASSIFIERS: dict[str, tuple[str, str, dict]] = {
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "qwen2_5", {}),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "qwen3", {"head_dim": 4}),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "llama3_2", {}),
}
REMOTE_CODE_MODEL = "tiny-RemoteForCausalLM"

REMOTE_CONFIGURATION = '''\
"""A Llama under another name, loaded as custom code (trust_remote_code) in the tests."""
from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
'''
REMOTE_MODELING = '''\
"""A Llama under another name, loaded as custom code (trust_remote_code) in the tests."""
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel

from .configuration_remote import RemoteConfig


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig
'''


def _init_tiny(model) -> None:
    import torch
    from torch import nn

    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


def _token_ids(tokenizer, family: dict) -> dict:
    ids = {"eos_token_id": tokenizer.convert_tokens_to_ids(family["eos"])}
    ids["bos_token_id"] = tokenizer.convert_tokens_to_ids(family["bos"]) if family.get("bos") else None
    ids["pad_token_id"] = tokenizer.convert_tokens_to_ids(family["pad"]) if family.get("pad") else None
    return ids


def build_model(model_type: str, family_name: str, overrides: dict, head: str, out_dir: Path) -> None:
    """Save a tiny bfloat16 model of `model_type` with its tokenizer and generation config into `out_dir`."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        GenerationConfig,
    )

    family = FAMILIES[family_name]
    tokenizer = build_tokenizer(family_name)
    ids = _token_ids(tokenizer, family)
    kwargs = dict(SMALL, vocab_size=len(tokenizer), tie_word_embeddings=False, **ids)
    kwargs.update(overrides)
    if head == "classification":
        kwargs["num_labels"] = 1
    config = AutoConfig.for_model(model_type, **kwargs)
    auto = AutoModelForSequenceClassification if head == "classification" else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config)
    _init_tiny(model)
    model = model.to(torch.bfloat16)
    with torch.no_grad():  # a forward, to catch a config this transformers refuses
        model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in family.get("generation_eos", [family["eos"]])]
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=eos if len(eos) > 1 else eos[0],
                     pad_token_id=ids["pad_token_id"]).save_pretrained(out_dir)


# repo -> (builder in tests/vlm_models.py, its arguments)
# (the Qwen ones with a byte-level BPE tokenizer, as TRL's have, so that prompts have about the lengths TRL's tests
# expect: TRL's test_train_vlm_with_max_length cuts a 38-token pair at 37 tokens)
VISION_LMS = {"tiny-Gemma3ForConditionalGeneration": ("build_gemma3", {}),
              "tiny-LlavaForConditionalGeneration": ("build_llava", {"vision_feature_layer": -2}),
              "tiny-Qwen2VLForConditionalGeneration": ("build_qwen2_vl", {"tokenizer": "qwen2_vl"}),
              "tiny-Qwen2_5_VLForConditionalGeneration": ("build_qwen2_5_vl", {"tokenizer": "qwen2_vl"}),
              "tiny-Idefics3ForConditionalGeneration": ("build_idefics3", {})}
VLM_MODELS = Path(__file__).resolve().parents[1] / "vlm_models.py"


def _vlm_models():
    """tests/vlm_models.py, imported by path (the harness runs outside the repository's package layout)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vlm_models", VLM_MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def processor_prelude() -> str:
    """Conftest prelude registering the Qwen2-VL / Qwen2.5-VL fixtures' processors with `AutoProcessor`: they are
    saved without a video processor (which needs torchvision, not importable here), under a class name of their
    own (`Qwen2VLProcessorWithoutVideo`, ...) that only this registration resolves. Applied to both sides alike."""
    return ("# trl_suite: the tiny Qwen2-VL / Qwen2.5-VL processors have no video processor (no torchvision here)\n"
            "import importlib.util as _trl_suite_vlm_util\n"
            "_trl_suite_spec = _trl_suite_vlm_util.spec_from_file_location(\n"
            f"    'trl_suite_vlm_models', {str(VLM_MODELS)!r})\n"
            "_trl_suite_vlm = _trl_suite_vlm_util.module_from_spec(_trl_suite_spec)\n"
            "_trl_suite_spec.loader.exec_module(_trl_suite_vlm)\n"
            "_trl_suite_vlm.register_processors_without_video()\n\n")


def build_vision_model(builder: str, kwargs: dict, out_dir: Path) -> None:
    """Save a tiny bfloat16 vision-language model and its processor (`tests/vlm_models.py`'s `builder`)."""
    import torch

    if "tokenizer" in kwargs:  # a tokenizer family of FAMILIES, with its vision tokens as named attributes
        family = kwargs["tokenizer"]
        tokenizer = build_tokenizer(family)
        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VISION_TOKENS.values())})
        for name, token in QWEN_VISION_TOKENS.items():
            setattr(tokenizer, name, token)
            setattr(tokenizer, f"{name}_id", tokenizer.convert_tokens_to_ids(token))
        kwargs = dict(kwargs, tokenizer=tokenizer, chat_template=FAMILIES[family]["template"])
    model, processor = getattr(_vlm_models(), builder)(**kwargs)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)


def build_remote_code_model(out_dir: Path) -> None:
    """A model whose classes live in the repository (custom code, needs `trust_remote_code=True`)."""
    import importlib.util
    import sys

    import torch
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    pkg = out_dir / "_remote_src"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "configuration_remote.py").write_text(REMOTE_CONFIGURATION)
    (pkg / "modeling_remote.py").write_text(REMOTE_MODELING)
    spec = importlib.util.spec_from_file_location("_remote_src", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["_remote_src"] = module
    from _remote_src.configuration_remote import RemoteConfig  # noqa: E402
    from _remote_src.modeling_remote import RemoteForCausalLM  # noqa: E402

    family = FAMILIES["llama3_2"]
    tokenizer = build_tokenizer("llama3_2")
    config = RemoteConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, **SMALL,
                          **_token_ids(tokenizer, family))
    config.auto_map = {"AutoConfig": "configuration_remote.RemoteConfig",
                       "AutoModel": "modeling_remote.RemoteModel",
                       "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
                       "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification"}
    torch.manual_seed(0)
    model = RemoteForCausalLM(config)
    _init_tiny(model)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=config.eos_token_id, bos_token_id=config.bos_token_id).save_pretrained(out_dir)
    for name in ("configuration_remote.py", "modeling_remote.py"):
        shutil.copy(pkg / name, out_dir / name)
    shutil.rmtree(pkg)
    del sys.modules["_remote_src"]


# ----------------------------------------------------------------------------------------------- data sets
def _split_line(line: str) -> tuple[str, str]:
    """'Beautiful is better than ugly.' -> ('Beautiful is better than', ' ugly.')."""
    words = line.split(" ")
    cut = max(1, len(words) // 2)
    return " ".join(words[:cut]), " " + " ".join(words[cut:])


def zen_configs() -> dict[str, dict[str, list]]:
    """The `zen` configs TRL's DPO and GRPO tests load, as columns of 19 rows."""
    lines = zen_lines()
    prompts, completions = zip(*(_split_line(line) for line in lines))
    prompts, completions = list(prompts), list(completions)
    # a rejected answer is another aphorism's ending (shifted by 7, so never the chosen one)
    rejected = [completions[(i + 7) % len(lines)] for i in range(len(lines))]
    questions = [f"How does this continue: {p}?" for p in prompts]

    def user(text):
        return [{"role": "user", "content": text}]

    def assistant(text):
        return [{"role": "assistant", "content": text.strip()}]

    labels = [i % 3 != 1 for i in range(len(lines))]
    return {
        "standard_language_modeling": {"text": lines},
        "standard_prompt_only": {"prompt": prompts},
        "standard_prompt_completion": {"prompt": prompts, "completion": completions},
        "standard_preference": {"prompt": prompts, "chosen": completions, "rejected": rejected},
        "standard_implicit_prompt_preference": {"chosen": [p + c for p, c in zip(prompts, completions)],
                                                "rejected": [p + r for p, r in zip(prompts, rejected)]},
        "standard_unpaired_preference": {"prompt": prompts, "completion": [
            c if keep else r for c, r, keep in zip(completions, rejected, labels)], "label": labels},
        "conversational_language_modeling": {"messages": [user(q) + assistant(c) for q, c in
                                                          zip(questions, completions)]},
        "conversational_prompt_only": {"prompt": [user(q) for q in questions]},
        "conversational_prompt_completion": {"prompt": [user(q) for q in questions],
                                             "completion": [assistant(c) for c in completions]},
        "conversational_preference": {"prompt": [user(q) for q in questions],
                                      "chosen": [assistant(c) for c in completions],
                                      "rejected": [assistant(r) for r in rejected]},
        "conversational_implicit_prompt_preference": {
            "chosen": [user(q) + assistant(c) for q, c in zip(questions, completions)],
            "rejected": [user(q) + assistant(r) for q, r in zip(questions, rejected)]},
        "conversational_unpaired_preference": {
            "prompt": [user(q) for q in questions],
            "completion": [assistant(c if keep else r) for c, r, keep in zip(completions, rejected, labels)],
            "label": labels},
    }


TOOLS = [
    {"type": "function", "function": {"name": "start_timer", "description": "Start a timer.", "parameters": {
        "type": "object", "properties": {"duration": {"type": "integer", "description": "Seconds."}},
        "required": ["duration"]}}},
    {"type": "function", "function": {"name": "get_current_time", "description": "Current time in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "The city."}},
                                          "required": ["city"]}}},
]


def toolcall_preference() -> dict[str, list]:
    """Preference rows whose completions call a tool and read its result (TRL's `toolcall` `preference` columns)."""
    rows = []
    for minutes in (1, 2, 3, 5, 10, 15, 20, 30):
        call = {"type": "function", "function": {"name": "start_timer", "arguments": {"duration": 60 * minutes}}}
        wrong = {"type": "function", "function": {"name": "start_timer", "arguments": {"duration": minutes}}}
        rows.append(dict(
            prompt=[{"role": "user", "content": f"Set a timer for {minutes} minutes."}],
            chosen=[{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "start_timer", "content": str(60 * minutes)},
                    {"role": "assistant", "content": f"Timer set for {minutes} minutes."}],
            rejected=[{"role": "assistant", "content": "", "tool_calls": [wrong]},
                      {"role": "tool", "name": "start_timer", "content": str(minutes)},
                      {"role": "assistant", "content": f"Timer set for {minutes} seconds."}],
            tools=[TOOLS[0]]))
    return {k: [r[k] for r in rows] for k in rows[0]}


def harmony_preference() -> dict[str, list]:
    """GPT-OSS (harmony) preference rows with `thinking` and per-row `chat_template_kwargs`."""
    lines = zen_lines()
    prompts, completions = zip(*(_split_line(line) for line in lines))
    efforts = ["low", "medium", "high"]
    return {
        "prompt": [[{"role": "user", "content": f"How does this continue: {p}?"}] for p in prompts],
        "chosen": [[{"role": "assistant", "thinking": "It is the aphorism's own ending.", "content": c.strip()}]
                   for c in completions],
        "rejected": [[{"role": "assistant", "thinking": "Any words will do.", "content": "Watermelon."}]
                     for _ in completions],
        "chat_template_kwargs": [{"reasoning_effort": efforts[i % 3],
                                  "model_identity": "You are a tiny language model."} for i in range(len(lines))],
    }


def zen_image_configs() -> dict[str, tuple[dict[str, list], object]]:
    """`zen-image`: the conversational prompt-only and preference configs, each row with a random RGB `image`
    (32-63 pixels a side), as (columns, features)."""
    import numpy as np
    from datasets import Features, Image, Value

    message = [{"content": Value("string"), "role": Value("string")}]
    rng = np.random.default_rng(0)
    out = {}
    for name, message_columns in (("conversational_prompt_only", ["prompt"]),
                                  ("conversational_preference", ["prompt", "chosen", "rejected"])):
        columns = {c: zen_configs()[name][c] for c in message_columns}
        n = len(columns["prompt"])
        columns["image"] = [rng.integers(0, 256, size=(*rng.integers(32, 64, size=2), 3), dtype=np.uint8)
                            for _ in range(n)]
        out[name] = (columns, Features({**{c: message for c in message_columns}, "image": Image()}))
    return out


# images per row of TRL's `zen-multi-image` (scripts/generate_zen_multi_image_dataset.py): 0 to 3
MULTI_IMAGE_COUNTS = [1, 1, 2, 2, 1, 1, 2, 0, 2, 3, 1, 1, 3, 0, 1, 1, 1, 1, 0]


def zen_multi_image_configs() -> dict[str, tuple[dict[str, list], object]]:
    """`zen-multi-image`: the conversational prompt-only and preference configs with 0-3 random RGB images per row
    (an `images` list, 32-63 pixels a side) and messages of typed parts, the user turn's `{"type": "image"}`
    placeholders around its text as in TRL's data set, as (columns, features)."""
    import numpy as np
    from datasets import Features, Image, List, Value
    from PIL import Image as PILImage

    message = List({"content": List({"text": Value("string"), "type": Value("string")}), "role": Value("string")})
    rng = np.random.default_rng(1)
    zen = zen_configs()["conversational_preference"]
    prompts, images = [], []
    for i, (turn, n) in enumerate(zip(zen["prompt"], MULTI_IMAGE_COUNTS)):
        before = i % (n + 1)  # some placeholders before the text, the rest after it
        parts = ([{"type": "image", "text": None}] * before + [{"type": "text", "text": turn[0]["content"]}]
                 + [{"type": "image", "text": None}] * (n - before))
        prompts.append([{"role": "user", "content": parts}])
        images.append([PILImage.fromarray(rng.integers(0, 256, size=(*rng.integers(32, 64, size=2), 3),
                                                       dtype=np.uint8)) for _ in range(n)])

    def typed(messages):
        return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]

    chosen, rejected = [typed(m) for m in zen["chosen"]], [typed(m) for m in zen["rejected"]]
    return {"conversational_prompt_only": ({"prompt": prompts, "images": images},
                                           Features({"prompt": message, "images": List(Image())})),
            "conversational_preference": ({"prompt": prompts, "chosen": chosen, "rejected": rejected,
                                           "images": images},
                                          Features({"prompt": message, "chosen": message, "rejected": message,
                                                    "images": List(Image())}))}


def write_cached_dataset(datasets_dir: Path, repo: str, config_name: str, columns: dict[str, list],
                         features=None) -> None:
    """Write `columns` as the datasets-library cache of `ORG/repo` (config `config_name`), split 17 / 2 like TRL's."""
    from datasets import Dataset, DatasetInfo, SplitDict, SplitInfo
    from datasets.arrow_writer import ArrowWriter

    data = Dataset.from_dict(columns, features=features)
    splits = data.train_test_split(test_size=0.1, shuffle=False)
    digest = hashlib.sha256(f"{repo}/{config_name}/{data._fingerprint}".encode()).hexdigest()[:16]
    out = datasets_dir / f"{ORG}___{repo}" / config_name / "0.0.0" / digest
    out.mkdir(parents=True, exist_ok=True)
    split_dict = SplitDict(dataset_name=repo)
    for split, ds in splits.items():
        path = out / f"{repo}-{split}.arrow"
        with ArrowWriter(path=str(path), features=ds.features) as writer:
            writer.write_table(ds.data.table)
            num_examples, num_bytes = writer.finalize()
        split_dict.add(SplitInfo(name=split, num_examples=num_examples, num_bytes=num_bytes, dataset_name=repo))
    info = DatasetInfo(features=splits["train"].features, config_name=config_name, dataset_name=repo,
                       splits=split_dict, builder_name="parquet")
    info.write_to_directory(str(out))


# ----------------------------------------------------------------------------------------------- the hub
def _place_model(hub_dir: Path, repo: str, build) -> None:
    name = f"models--{ORG}--{repo}"
    commit = hashlib.sha1(f"{repo}:{FIXTURES_VERSION}".encode()).hexdigest()
    snapshot = hub_dir / name / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    build(snapshot)
    (hub_dir / name / "refs").mkdir(parents=True, exist_ok=True)
    (hub_dir / name / "refs" / "main").write_text(commit)


def build_hub(root: Path, log=print) -> Path:
    """Build (or reuse) the offline hub under `root/<stamp>` and return that directory (the `HF_HOME` to use).

    The stamp hashes this file and the transformers version: a changed fixture builds a new directory beside the
    old one (never deleting a hub another run may be reading); the build goes to a temporary directory renamed
    into place, so concurrent runs never see half a hub."""
    import tempfile

    import transformers

    stamp = hashlib.sha256((Path(__file__).read_text() + transformers.__version__).encode()).hexdigest()[:16]
    hf_home = Path(root) / stamp
    if (hf_home / "hub").is_dir():
        return hf_home
    Path(root).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{stamp}-", dir=root))
    hub_dir, datasets_dir = staging / "hub", staging / "datasets"
    hub_dir.mkdir()
    datasets_dir.mkdir()
    for repo, (model_type, family, overrides) in CAUSAL_LMS.items():
        log(f"building {ORG}/{repo}")
        _place_model(hub_dir, repo, lambda d, a=(model_type, family, overrides): build_model(*a, "causal_lm", d))
    for repo, (model_type, family, overrides) in SEQUENCE_CLASSIFIERS.items():
        log(f"building {ORG}/{repo}")
        _place_model(hub_dir, repo,
                     lambda d, a=(model_type, family, overrides): build_model(*a, "classification", d))
    for repo, (builder, kwargs) in VISION_LMS.items():
        log(f"building {ORG}/{repo}")
        _place_model(hub_dir, repo, lambda d, b=builder, k=kwargs: build_vision_model(b, k, d))
    log(f"building {ORG}/{REMOTE_CODE_MODEL}")
    _place_model(hub_dir, REMOTE_CODE_MODEL, build_remote_code_model)
    for config_name, columns in zen_configs().items():
        write_cached_dataset(datasets_dir, "zen", config_name, columns)
    write_cached_dataset(datasets_dir, "toolcall", "preference", toolcall_preference())
    write_cached_dataset(datasets_dir, "harmony", "preference", harmony_preference())
    for config_name, (columns, features) in zen_image_configs().items():
        write_cached_dataset(datasets_dir, "zen-image", config_name, columns, features)
    for config_name, (columns, features) in zen_multi_image_configs().items():
        write_cached_dataset(datasets_dir, "zen-multi-image", config_name, columns, features)
    log(f"datasets: zen ({len(zen_configs())} configs), zen-image, zen-multi-image, toolcall, harmony")
    try:
        staging.rename(hf_home)
    except OSError:  # another run finished the same build first
        shutil.rmtree(staging, ignore_errors=True)
    return hf_home


def offline_env(hf_home: Path) -> dict[str, str]:
    """Environment variables that make transformers / datasets / huggingface_hub read only this hub."""
    hf_home = str(hf_home)
    return {"HF_HOME": hf_home, "HF_HUB_CACHE": os.path.join(hf_home, "hub"),
            "HF_DATASETS_CACHE": os.path.join(hf_home, "datasets"), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


if __name__ == "__main__":  # python tests/trl_suite/hub_fixtures.py DIR: build and print the environment
    import sys

    home = build_hub(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/trl_suite_hub"))
    print(textwrap.indent("\n".join(f"{k}={v}" for k, v in offline_env(home).items()), "  "))
