"""Command line: `hf-verl demo` (also `python -m hf_verl demo`).

The only module that prints: it is the user-facing end of the demo; the library logs.
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-verl", description="RL post-training of LLMs with Hugging Face.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="Train a tiny model on a verifiable task with RL, offline, on a CPU.")
    demo.add_argument("--algo", default="grpo", choices=["grpo", "ppo", "dpo", "distill"],
                      help="grpo (group-relative, no critic), ppo (critic + GAE), dpo (offline preferences) or "
                           "distill (a GRPO-trained teacher distilled on-policy into a student with another "
                           "tokenizer; its own recipe: --seed, --rl-seconds, --threads, --output-dir apply).")
    demo.add_argument("--model", default=None, help="Hub id or path of a causal LM (default: a tiny Llama built in code).")
    demo.add_argument("--dataset", default=None,
                      help="Dataset name/path with 'prompt' and 'answer' columns (default: the reverse-string task).")
    demo.add_argument("--output-dir", default="hf_verl_demo",
                      help="Root of the runs: each run gets <output-dir>/<algo>/<time>-seed<seed>/ (metrics.jsonl, "
                           "reward.png, summary.json, model/) and <output-dir>/latest points at the last one.")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--max-steps", type=int, default=500, help="RL optimizer steps.")
    demo.add_argument("--rl-seconds", type=float, default=None,
                      help="Stop the RL phase early after this long (default: run all --max-steps).")
    demo.add_argument("--dpo-loss", default="sigmoid,sft",
                      help="--algo dpo: comma-separated DPO loss types (default sigmoid DPO + NLL on chosen, RPO).")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads (default: 1 for the built-in model, so that its figures do not depend on "
                           "the core count; torch's default with --model).")
    demo.add_argument("--learning-rate", type=float, default=None,
                      help="Peak learning rate of the RL phase (a linear rise over the first fifth of the steps, then "
                           "a linear decay to 0; PPO's policy at half of it, its critic at it). Default 5e-4; for GRPO "
                           "with an asynchronous --rollout 2.5e-4.")
    demo.add_argument("--num-generations", type=int, default=8, help="Completions per prompt (group size).")
    demo.add_argument("--prompts-per-step", type=int, default=16, help="Unique prompts per GRPO step.")
    demo.add_argument("--max-completion-length", type=int, default=6, help="Tokens per completion.")
    demo.add_argument("--rollout", default="sync", choices=["sync", "async", "in-flight", "partial"],
                      help="--algo grpo|ppo: sync (each round generated with the current weights), async (the next "
                           "round generated while this one trains), in-flight (async, and weight updates land in "
                           "the running generation) or partial (in-flight with 2 rounds generated ahead, decoded "
                           "together; docs/rollout.md).")
    serve = sub.add_parser("serve", help="Serve a model for rollouts (OpenAI-compatible, versioned weight updates), "
                                         "or a reward model on vLLM's /classify route.")
    serve.add_argument("model", help="Hub id or local path of a causal LM (or of a sequence-classification model).")
    serve.add_argument("--task", default="auto", choices=["auto", "generate", "classify"],
                       help="generate: /v1/completions; classify: a sequence-classification (reward) model on "
                            "/classify as vLLM serves it; auto: classify when the config names a "
                            "*ForSequenceClassification architecture.")
    serve.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    serve.add_argument("--host", default="127.0.0.1", help="Bind address (a non-loopback host needs a token).")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--token-file", default=None,
                       help="File holding the bearer token of the weight routes (else $HF_VERL_SERVE_TOKEN).")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--trust-remote-code", action="store_true", help="Allow custom model code from the Hub.")
    serve.add_argument("--max-model-len", type=int, default=None, help="--engine vllm: context length.")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="Name(s) requests may give as `model` (default: the model argument); others get 404.")
    serve.add_argument("--max-n", type=int, default=64, help="Cap on completions per prompt in one request.")
    serve.add_argument("--max-tokens", type=int, default=8192, help="Cap on max_tokens of one request.")
    serve.add_argument("--max-prompts", type=int, default=1024, help="Cap on prompts in one request.")
    serve.add_argument("--max-batch-rows", type=int, default=256,
                       help="Completions that concurrent requests sampling alike may share in one engine call.")
    serve.add_argument("--continuous-batching", action="store_true",
                       help="--engine transformers: decode concurrent requests in one shared loop, each request's rows "
                            "joining and leaving it between two decode steps (for a generator that several rounds or "
                            "trainers use at once; docs/rollout.md).")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                       help="--engine vllm: share of GPU memory (on CPU: of host memory) vLLM reserves.")
    return parser


def run_serve(args) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.serve.classify import is_classifier
    from hf_verl.serve.server import RolloutServer, read_token

    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    task = args.task
    if task == "auto":
        config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        task = "classify" if is_classifier(config) else "generate"
    if task == "classify":
        return run_serve_classify(args, tokenizer)
    token = read_token(args.token_file)
    if args.engine == "vllm":
        from hf_verl.rollout.vllm_engine import VLLMEngine

        if args.trust_remote_code:
            raise SystemExit("--trust-remote-code is not passed to vLLM by hf-verl serve; use --engine transformers.")
        engine = VLLMEngine(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                            gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype),
                                                     use_safetensors=True, trust_remote_code=args.trust_remote_code)
        engine = TransformersEngine(model.eval(), tokenizer)
    names = args.served_model_name or [args.model]
    server = RolloutServer(engine, tokenizer, names[0], host=args.host, port=args.port, token=token,
                           served_model_names=names, max_n=args.max_n, max_tokens=args.max_tokens,
                           max_prompts=args.max_prompts, max_batch_rows=args.max_batch_rows,
                           continuous_batching=args.continuous_batching)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def run_serve_classify(args, tokenizer) -> int:
    import torch
    from transformers import AutoModelForSequenceClassification

    from hf_verl.serve.classify import ClassifyServer

    if args.engine != "transformers":
        raise SystemExit("--task classify runs on --engine transformers; for vLLM use "
                         "`vllm serve <model> --runner pooling` (the same /classify route).")
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), use_safetensors=True, trust_remote_code=args.trust_remote_code)
    names = args.served_model_name or [args.model]
    server = ClassifyServer(model, tokenizer, names[0], host=args.host, port=args.port, served_model_names=names,
                            max_prompts=args.max_prompts)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def print_summary(result) -> None:
    print(f"warm-up: {result.warmup_steps} supervised steps, train greedy accuracy {result.warmup_train_accuracy:.1%}")
    stage = "distillation" if "teacher_accuracy" in result.extra else "RL"
    print(f"held-out greedy accuracy before {stage}: {result.accuracy_before:.1%}")
    print(f"held-out greedy accuracy after  {stage}: {result.accuracy_after:.1%}  "
          f"({result.rl_steps} optimizer steps, {result.rl_seconds:.0f} s)")
    for key, value in result.extra.items():
        print(f"{key.replace('_', ' ')}: {value:.1%}")
    print(f"wrote {', '.join(result.files)} (total {result.wall_seconds:.0f} s)")
    model_dir = result.model_dir
    print(f"trained model: {model_dir}  ({result.latest} points at this run)")
    print("  serve it (from the activated venv: source .venv/bin/activate):")
    print(f"    hf-verl serve {model_dir} --served-model-name demo")
    print("  load it in Python:")
    print(f"    AutoModelForCausalLM.from_pretrained({model_dir!r}); AutoTokenizer.from_pretrained({model_dir!r})")
    print("  more: docs/saving_and_serving.md")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        # bitsandbytes (the `qlora` extra) warns at import on CPU machines without the optional `kernels` package,
        # about 4-bit CPU kernels the demo never uses: keep it out of the first thing a user runs
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "demo" and args.algo == "distill":
        from hf_verl.demo.entry import run_demo

        print_summary(run_demo(args.output_dir, algo="distill", seed=args.seed, rl_seconds=args.rl_seconds,
                               num_threads=args.threads, model_name=args.model, dataset_name=args.dataset))
    elif args.command == "demo":
        from hf_verl.demo.entry import run_demo

        result = run_demo(args.output_dir, algo=args.algo, model_name=args.model, dataset_name=args.dataset,
                          seed=args.seed, rl_seconds=args.rl_seconds, max_steps=args.max_steps,
                          dpo_loss=tuple(t.strip() for t in args.dpo_loss.split(",") if t.strip()),
                          learning_rate=args.learning_rate, num_generations=args.num_generations,
                          prompts_per_step=args.prompts_per_step,
                          max_completion_length=args.max_completion_length, num_threads=args.threads,
                          rollout=args.rollout)
        print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
