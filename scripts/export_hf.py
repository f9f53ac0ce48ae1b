"""Export the policy of a run's checkpoint as a Hugging Face model directory (weights, config, tokenizer files)
that `transformers.AutoModelForCausalLM.from_pretrained` and `--model DIR` load.

    python scripts/export_hf.py runs/grpo-20260101-120000 --step 100 --out exported/step100
"""

import argparse
import pathlib
import sys

from rpegjax.train.export import export_policy, is_run_directory, load_run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (config.json and checkpoints/)")
    parser.add_argument("--step", type=int, help="the checkpoint to export (default: the latest complete one)")
    parser.add_argument("--out", metavar="DIR", help="where to write the model (default: RUN_DIR/hf-step<N>)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    args = parser.parse_args(argv)
    say = lambda message: print(message, file=sys.stderr, flush=True)
    run_dir = pathlib.Path(args.run_dir)
    if not is_run_directory(run_dir):
        parser.error(f"{run_dir}: not a run directory (it needs config.json and checkpoints/)")
    try:
        parts, params, step = load_run(run_dir, args.step, log=say)
        out = pathlib.Path(args.out) if args.out else run_dir / f"hf-step{step}"
        if out.exists() and not args.overwrite:
            say(f"error: {out} exists (use --overwrite to replace it, or another --out)")
            return 2
        export_policy(parts, params, out)
    except (ValueError, RuntimeError, OSError) as error:  # CheckpointError is a RuntimeError
        say(f"error: {error}")
        return 2 if not isinstance(error, OSError) else 1
    say(f"step {step} of {run_dir} written to {out}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
