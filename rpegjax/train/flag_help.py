"""What each short flag of the training jobs means, for `--help`: a metavar that says what to write and a
sentence that says what it does (the CLI appends the config field it sets, its default and its choices)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlagHelp:
    metavar: str
    meaning: str


FLAG_HELP: dict[str, FlagHelp] = {
    # model and data
    "model": FlagHelp(metavar="DIR", meaning="fine-tune this local Hugging Face checkpoint (Qwen2/Qwen2.5, Qwen3, "
                      "Qwen3-MoE, Llama 3; safetensors and tokenizer files); without it a small model for the built-in "
                      "character tokenizer is built"),
    "dataset": FlagHelp(metavar="PATH", meaning="train on this JSONL or Parquet file, directory of Parquet files or "
                        "`save_to_disk` directory (GSM8K, MATH or prompt/answer rows) instead of the built-in task; "
                        "turns the warm start off (a dataset has no worked solutions): give --model too"),
    "eval-dataset": FlagHelp(metavar="PATH", meaning="measure held-out accuracy on this file instead of a hashed "
                             "share of --dataset"),
    "dataset-format": FlagHelp(metavar="FORMAT", meaning="how rows are read, when detection from the first row "
                               "is not wanted"),
    "prompt-field": FlagHelp(metavar="NAME", meaning="the row field that holds the prompt, when not the format's own"),
    "answer-field": FlagHelp(metavar="NAME", meaning="the row field that holds the gold answer, when not the "
                             "format's own"),
    "chat-template": FlagHelp(metavar="MODE", meaning="render prompts through the model tokenizer's chat template "
                              "(auto: when it has one; required: a tokenizer without one is an error)"),
    "system-prompt": FlagHelp(metavar="TEXT", meaning="the system turn of the chat template"),
    "task": FlagHelp(metavar="TASK", meaning="the built-in generated task to learn"),
    "difficulty": FlagHelp(metavar="LEVEL", meaning="the built-in task's problem sizes"),
    # graph and placement
    "mesh": FlagHelp(metavar="AXES", meaning="the training devices' mesh, e.g. data=2,fsdp=2,tensor=2 (one size "
                     "may be -1: the rest)"),
    "async-bound": FlagHelp(metavar="K", meaning="generation reads weights K versions old while training runs "
                            "(0: synchronous, on-policy)"),
    "rollout-devices": FlagHelp(metavar="N", meaning="generate on the first N devices and train on the rest "
                                "(0: both share every device)"),
    "rollout-mesh": FlagHelp(metavar="AXES", meaning="the generation devices' mesh when --rollout-devices > 0"),
    "plan": FlagHelp(metavar="FILE.json", meaning="execute this planned graph (scripts/plan.py --json output or a "
                     "graph JSON) instead of the one these flags describe"),
    "fuse": FlagHelp(metavar="BOOL", meaning="fuse the inference stages (reference/old log-probs, values) into "
                     "one program"),
    "microbatches": FlagHelp(metavar="N", meaning="hand each step's rollouts downstream in N pieces as they finish "
                             "(must divide --prompts-per-step)"),
    # rollout
    "group-size": FlagHelp(metavar="G", meaning="samples per prompt (GRPO's group; at least 2)"),
    "prompts-per-step": FlagHelp(metavar="P", meaning="prompts sampled per training step"),
    "max-prompt-len": FlagHelp(metavar="N", meaning="prompt tokens the sampler holds (unset: the data's longest "
                               "prompt; a longer prompt is an error naming its row)"),
    "max-new-tokens": FlagHelp(metavar="N", meaning="response tokens per sample"),
    "temperature": FlagHelp(metavar="T", meaning="sampling temperature of the rollouts (the learners' "
                            "log-probs use it too)"),
    "env": FlagHelp(metavar="ENV", meaning="multi-turn rollouts with a tool: the model may call it and read its "
                    "answer before it answers"),
    "max-turns": FlagHelp(metavar="N", meaning="model turns per episode with --env"),
    "episode-token-budget": FlagHelp(metavar="N", meaning="response tokens per episode, model and tool together "
                                     "(unset: --max-new-tokens)"),
    # the run
    "steps": FlagHelp(metavar="N", meaning="RL training steps to run (after the warm start)"),
    "seed": FlagHelp(metavar="N", meaning="seed of sampling and of the run's random streams"),
    "run-dir": FlagHelp(metavar="DIR", meaning="where the run writes (unset: runs/<algorithm>-<time>; a non-empty "
                        "directory is refused without --resume or --overwrite)"),
    "checkpoint-every": FlagHelp(metavar="N", meaning="write a checkpoint every N steps (and at the end)"),
    "eval-every": FlagHelp(metavar="N", meaning="measure held-out accuracy every N steps besides the start and "
                           "the end (0: only those)"),
    "sample-every": FlagHelp(metavar="N", meaning="show and save a few sampled completions every N steps (0: never)"),
    "max-nonfinite-steps": FlagHelp(metavar="N", meaning="steps with a non-finite loss or gradient tolerated "
                                    "before the run stops with an error"),
    "reward-memory-mb": FlagHelp(metavar="MB", meaning="memory limit of each reward worker process"),
    "reward-cpu-s": FlagHelp(metavar="SECONDS", meaning="CPU-time limit of each reward worker process"),
    "warm-start-steps": FlagHelp(metavar="N", meaning="supervised steps on the built-in task's worked solutions "
                                 "before RL (0: none; cached, so a second run skips them)"),
    # LoRA
    "lora-rank": FlagHelp(metavar="R", meaning="train rank-R LoRA adapters instead of every weight (0: full "
                          "fine-tuning)"),
    "lora-alpha": FlagHelp(metavar="ALPHA", meaning="LoRA scale numerator: adapters are scaled by alpha / rank"),
    "lora-targets": FlagHelp(metavar="LIST", meaning="comma-separated projections that get adapters"),
    "lora-dropout": FlagHelp(metavar="P", meaning="dropout on the adapters' input in the update (PEFT's "
                             "lora_dropout)"),
    "lora-generation": FlagHelp(metavar="MODE", meaning="what the sampler decodes: the base model with the "
                                "adapters merged (merged) or the adapted model (adapters)"),
    "lora-lr": FlagHelp(metavar="LR", meaning="learning rate of a LoRA run (unset: 10 x --lr)"),
    # algorithm (the script's own section)
    "advantage": FlagHelp(metavar="KIND", meaning="how rewards become advantages"),
    "dynamic-sampling": FlagHelp(metavar="BOOL", meaning="DAPO's dynamic sampling: drop groups whose rewards all "
                                 "agree and sample more prompts"),
    "overlong-buffer": FlagHelp(metavar="N", meaning="DAPO's soft overlong penalty over the last N tokens of the "
                                "response budget (0: off)"),
    "overlong-penalty": FlagHelp(metavar="F", meaning="the overlong penalty's scale"),
    "critic": FlagHelp(metavar="MODE", meaning="PPO's critic: a separate model, or a value head on the actor's "
                       "trunk (shared)"),
    "lr": FlagHelp(metavar="LR", meaning="the optimiser's learning rate"),
    "kl-coef": FlagHelp(metavar="BETA", meaning="weight of the KL penalty to the reference model (0: no "
                        "reference model)"),
    "loss": FlagHelp(metavar="KIND", meaning="the policy loss: PPO's clipped token ratio or GSPO's sequence ratio"),
    "clip-low": FlagHelp(metavar="EPS", meaning="the ratio clip below 1 (1 - eps)"),
    "clip-high": FlagHelp(metavar="EPS", meaning="the ratio clip above 1 (1 + eps; > --clip-low is DAPO's "
                          "clip-higher)"),
    "aggregation": FlagHelp(metavar="KIND", meaning="how token losses are averaged into the batch loss"),
    "correction": FlagHelp(metavar="KIND", meaning="the train/rollout mismatch correction of decoupled PPO: token or "
                           "sequence truncated importance sampling, IcePop token masks, geometric-mean sequence masks"),
    "epochs": FlagHelp(metavar="N", meaning="passes over each step's rollouts"),
    "minibatches": FlagHelp(metavar="N", meaning="optimiser steps per epoch (the batch split in N)"),
}
