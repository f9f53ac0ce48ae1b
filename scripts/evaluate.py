"""Measure a policy: greedy accuracy and pass@k on a built-in task's held-out problems or on a JSONL dataset.

    python scripts/evaluate.py runs/grpo-20260101-120000                       # the run's own held-out split
    python scripts/evaluate.py runs/grpo-20260101-120000/hf --task countdown --samples 8 --temperature 1.0
    python scripts/evaluate.py MODEL_DIR --dataset test.jsonl --out answers.jsonl

SOURCE is a run directory (its latest checkpoint, or --step N) or a Hugging Face model directory. The last
line of standard output is a JSON summary.
"""

import argparse
import json
import sys

from rpegjax.generate.sampling import SamplingConfig
from rpegjax.train.evaluation import generate_answers, mean_pass_at_k
from rpegjax.train.trainer import episode_runner


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="SOURCE", help="a run directory or a Hugging Face model directory")
    parser.add_argument("--step", type=int, help="checkpoint of a run directory (default: the latest)")
    parser.add_argument("--task", help="a built-in task (arithmetic, countdown); default: the run's data, or arithmetic")
    parser.add_argument("--difficulty", help="of the built-in task (easy, medium, hard)")
    parser.add_argument("--dataset", metavar="FILE.jsonl", help="evaluate on every row of this file instead")
    parser.add_argument("--eval-size", type=int, help="at most this many problems (default: the run's data.eval_size)")
    parser.add_argument("--samples", type=int, default=1, help="completions per problem for pass@k (default 1: "
                        "greedy accuracy only)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the pass@k samples")
    parser.add_argument("--max-new-tokens", type=int, help="default: the run's rollout.max_new_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="FILE.jsonl", help="write every answer (prompt, response, verdict) here")
    args = parser.parse_args(argv)
    say = lambda message: print(message, file=sys.stderr, flush=True)
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    if args.dataset and (args.task or args.difficulty):
        parser.error("--dataset replaces the built-in task: give --dataset or --task/--difficulty, not both")

    from rpegjax.train.export import load_policy

    data: dict = {"train_size": 1}  # training problems are not needed (the held-out split does not depend on them)
    if args.dataset:
        data.update(dataset=args.dataset, eval_dataset=args.dataset, dataset_format=None)
    for name, value in (("task", args.task), ("difficulty", args.difficulty), ("eval_size", args.eval_size)):
        if value is not None:
            data[name] = value
    if args.task or args.difficulty:
        data.update(dataset=None, eval_dataset=None, dataset_format=None)
    rollout: dict = {"max_prompt_len": None}
    if args.samples > 1:  # pass@k samples come in groups of k; greedy alone keeps the run's group (GRPO needs >= 2)
        rollout["group_size"] = args.samples
    if args.max_new_tokens is not None:
        rollout["max_new_tokens"] = args.max_new_tokens
    try:
        parts, params, what = load_policy(args.source, step=args.step, changes={"data": data, "rollout": rollout},
                                          log=say)
        examples = parts.eval_examples
        prompts = parts.prompt_ids(examples)
        # a run with a tool environment answers in episodes (model turns and tool calls), as it trained
        episodes = episode_runner(parts, SamplingConfig(max_new_tokens=parts.cfg.rollout.max_new_tokens))
        common = dict(is_correct=parts.task.is_correct, decode=parts.decode, episodes=episodes)
        max_new = parts.cfg.rollout.max_new_tokens
        greedy = generate_answers(parts.sampler, params, examples, prompts, **common,
                                  sampling=SamplingConfig(max_new_tokens=max_new, greedy=True))
        accuracy = sum(group[0].correct for group in greedy) / len(greedy)
        summary = {"source": what, "problems": len(examples), "accuracy": accuracy}
        sampled = []
        if args.samples > 1:
            sampled = generate_answers(parts.sampler, params, examples, prompts, **common, samples_per_example=args.samples,
                                       sampling=SamplingConfig(max_new_tokens=max_new, temperature=args.temperature),
                                       seed=args.seed)
            ks = sorted({1, *(k for k in (2, 4, 8, 16, 32, 64, 128) if k < args.samples), args.samples})
            summary.update({f"pass@{k}": value for k, value in mean_pass_at_k(sampled, ks).items()},
                           samples=args.samples, temperature=args.temperature)
    except (ValueError, RuntimeError, OSError) as error:
        say(f"error: {error}")
        return 2
    if args.out:
        with open(args.out, "w") as handle:
            for kind, groups in (("greedy", greedy), ("sampled", sampled)):
                for group in groups:
                    for answer in group:
                        handle.write(json.dumps({"kind": kind, "id": answer.example.id, "prompt": answer.example.prompt,
                                                 "response": answer.response, "answer": answer.example.answer,
                                                 "correct": answer.correct}) + "\n")
    say(f"{what}: accuracy {accuracy:.3f} on {len(examples)} problems (greedy)"
        + "".join(f", {key} {value:.3f}" for key, value in summary.items() if key.startswith("pass@")))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
