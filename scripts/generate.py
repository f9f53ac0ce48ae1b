"""Sample completions from a policy: a run directory (latest checkpoint, or --step N) or a Hugging Face model
directory. Prompts are rendered with the run's prompt template, as in training.

    python scripts/generate.py runs/grpo-20260101-120000 --prompt "Q:12+30" --samples 4
    python scripts/generate.py runs/grpo-20260101-120000/hf --prompts prompts.txt --greedy

Each completion is one JSON line on standard output: prompt, sample, response, finish reason.
"""

import argparse
import json
import pathlib
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="SOURCE", help="a run directory or a Hugging Face model directory")
    parser.add_argument("--step", type=int, help="checkpoint of a run directory (default: the latest)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts", metavar="FILE", help="a file of prompts: one per line, or JSONL with a "
                        "\"prompt\" field")
    parser.add_argument("--samples", type=int, default=1, help="completions per prompt")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (then --samples must be 1)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, help="default: the run's rollout.max_new_tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    say = lambda message: print(message, file=sys.stderr, flush=True)
    prompts = list(args.prompt)
    if args.prompts:
        try:
            prompts += read_prompts(pathlib.Path(args.prompts))
        except (OSError, ValueError) as error:
            parser.error(str(error))
    if not prompts:
        parser.error("give at least one --prompt or a --prompts file")
    if args.samples < 1 or (args.greedy and args.samples != 1):
        parser.error(f"--samples must be >= 1 (and 1 with --greedy), got {args.samples}")

    import jax

    from rpegjax.data.example import Example
    from rpegjax.generate.sampling import SamplingConfig
    from rpegjax.train.export import load_policy

    examples = [Example(id=str(i), prompt=text, answer="", task="prompt") for i, text in enumerate(prompts)]
    rollout: dict = {"max_prompt_len": None}
    # the sampler takes any number of samples per prompt, but the run's config also describes training, whose
    # GRPO group needs >= 2: one sample (greedy or not) keeps the run's group, more size the sampler's slots
    if args.samples > 1:
        rollout["group_size"] = args.samples
    if args.max_new_tokens is not None:
        rollout["max_new_tokens"] = args.max_new_tokens
    # the user's prompts may be longer than the task's: the sampler is sized for the longest of both
    changes = {"rollout": rollout, "data": {"train_size": 1, "eval_size": 1}}
    try:
        parts, params, what = load_policy(args.source, step=args.step, changes=changes, log=say)
        ids = parts.prompt_ids(examples)
        if max(map(len, ids)) > parts.max_prompt_len:
            rollout["max_prompt_len"] = max(map(len, ids))
            parts, params, what = load_policy(args.source, step=args.step, changes=changes, log=say)
        sampling = SamplingConfig(max_new_tokens=parts.cfg.rollout.max_new_tokens, greedy=args.greedy,
                                  temperature=args.temperature, top_p=args.top_p)
        completions = parts.sampler.generate(params, ids, sampling, group_size=args.samples,
                                             key=jax.random.key(args.seed))
    except (ValueError, RuntimeError, OSError) as error:
        say(f"error: {error}")
        return 2
    say(f"{len(completions)} completions from {what}")
    for completion in completions:
        print(json.dumps({"prompt": prompts[completion.prompt_index], "sample": completion.sample_index,
                          "response": parts.decode(completion.response_ids),
                          "finish_reason": str(completion.finish_reason)}), flush=True)
    return 0


def read_prompts(path: pathlib.Path) -> list[str]:
    """Prompts of a file: JSONL rows with a "prompt" string (when every line is such an object), else one
    prompt per non-empty line."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            return lines
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number}: a JSON line needs a \"prompt\" string")
        rows.append(row["prompt"])
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
