"""Where W-small's time goes (shared/WORKLOADS.md): XLA:CPU's per-op times of the update, the log-prob pass and the
decode chunks, beside torch's per-op times of the same update.

    python benchmarks/profile_wsmall.py [--runs 3] [--top 12] [--programs update logprobs contiguous paged torch] \
        [--new-tokens 64] [--greedy] [--json FILE]

Programs (the W-small model, 32 rows of 32 prompt + 64 response tokens, GRPO with the reference KL in the loss):
  * update     `GRPOLearner.update` (forward, backward, AdamW);
  * logprobs   `GRPOLearner.logprobs` (the reference / old log-prob pass);
  * decode     `Sampler.generate` of 64 new tokens (`--new-tokens`) at temperature 1 (`--greedy`: argmax) (admit,
               then chunks of 16 steps, each on the live bucket of the running rows), for each cache layout
               (contiguous and paged).
Each runs once to compile, then `--runs` times inside a `jax.profiler` trace with XLA:CPU's per-op trace events on
(`--xla_cpu_enable_xprof_traceme`); every executed HLO op (a fusion, a dot, a copy, ...) is one event. Its time is
attributed to a kind read from the compiled HLO (`op_kinds`): a matmul (a dot, or a fusion holding one), a layout
copy (copy or transpose), a scatter / gather / dynamic-update-slice, a reduction, or elementwise; container ops
(while loops, calls, conditionals) are left out so that no time counts twice. Printed: each program's time per
run, its shares by kind and its largest ops, all and non-matmul (with the JAX operation XLA recorded), and for the decode the matmul
and non-matmul time per step.

torch: `Qwen2ForCausalLM` from transformers with the same shapes, the same per-token GRPO loss (clipped ratio,
k3 KL to reference log-probs, token mean) and `torch.optim.AdamW`, under `torch.profiler`; shares of self CPU
time by op (matmuls: mm / addmm / bmm / linear's backward). The machine is shared: shares, not seconds, compare.
"""

from __future__ import annotations

import os

# per-op trace events of XLA:CPU; must be set before jax starts its backend
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

import argparse
import collections
import glob
import json
import re
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from rpegjax.generate import Sampler, SamplingConfig
from rpegjax.generate.paged_cache import CacheConfig
from rpegjax.models import Decoder, ModelConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wsmall_parts import GROUP, PROMPT_LEN, PROMPTS, RESPONSE_LEN, training_programs  # noqa: E402
KINDS = ("matmul", "layout copy", "scatter/gather", "reduction", "elementwise")
PROGRAMS = ("update", "logprobs", "contiguous", "paged", "torch")
CONTAINERS = ("while", "call", "conditional", "async")


def op_kinds(hlo_text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Kind (one of KINDS, or 'container') and JAX operation name of every instruction of a compiled HLO module, by name;
    a fusion takes the kind of what it holds (a dot first, then a scatter or gather, a reduce, a transpose)."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None and "=" in line:
            current.append(line)
    kinds, sources = {}, {}

    def kind_of_ops(lines: list[str]) -> str:
        text = "\n".join(lines)
        ops = set(re.findall(r"= [^ ]+ ([a-z\-]+)\(", text))
        if ops & {"dot", "convolution"} or "__onednn$matmul" in text or "xnn" in text:
            return "matmul"
        if ops & {"scatter", "gather", "dynamic-update-slice", "dynamic-slice"}:
            return "scatter/gather"
        if ops & {"reduce", "reduce-window", "sort"}:
            return "reduction"
        if ops & {"transpose", "copy"} and not ops - {"transpose", "copy", "parameter", "bitcast", "reshape"}:
            return "layout copy"
        return "elementwise"

    for lines in computations.values():
        for line in lines:
            match = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^ ]+ ([a-z\-]+)\(", line)
            if not match:
                continue
            name, op = match.groups()
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if op == "fusion" and called:
                kinds[name] = kind_of_ops(computations.get(called.group(1), []))
            elif op in CONTAINERS or op.endswith("-start") or op.endswith("-done"):
                kinds[name] = "container"
            elif op == "custom-call":
                kinds[name] = "matmul" if "matmul" in line or "gemm" in line.lower() else "elementwise"
            else:
                kinds[name] = kind_of_ops([line])
            source = re.search(r'op_name="([^"]+)"', line)
            if source:  # the JAX operation and its transformations (transpose(jvp(...)): the backward pass)
                sources[name] = source.group(1).split("/", 1)[-1][-90:]
    return kinds, sources


def traced_ops(run, runs: int) -> tuple[collections.Counter, float]:
    """Nanoseconds per op name over `runs` calls of `run` inside a profiler trace, and the wall seconds per run."""
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        with jax.profiler.trace(directory):
            for _ in range(runs):
                jax.block_until_ready(run())
        wall = (time.perf_counter() - start) / runs
        path = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
    times: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                times[event.name] += event.duration_ns
    return times, wall


def breakdown(name: str, times: collections.Counter, kinds: dict[str, str], sources: dict[str, str], runs: int,
              top: int, steps: int | None = None) -> dict:
    """Prints and returns the shares of the known ops' time by kind and the largest ops."""
    known = {op: ns / runs for op, ns in times.items() if kinds.get(op, "container") != "container"}
    total = sum(known.values())
    by_kind = collections.Counter()
    for op, ns in known.items():
        by_kind[kinds[op]] += ns
    print(f"{name}: {total / 1e6:.1f} ms of ops per run ({len(known)} distinct ops)")
    print("  " + ", ".join(f"{kind} {by_kind[kind] / total:.0%}" for kind in KINDS))
    if steps:
        matmul = by_kind["matmul"] / steps
        rest = (total - by_kind["matmul"]) / steps
        print(f"  per decode step: matmul {matmul / 1e3:.0f} us, the rest {rest / 1e3:.0f} us "
              f"(rest / matmul {rest / matmul:.2f})")
    largest = sorted(known.items(), key=lambda item: -item[1])
    for title, ops in (("largest ops", largest), ("largest non-matmul ops", [x for x in largest if kinds[x[0]] != "matmul"])):
        print(f"  {title}:")
        for op, ns in ops[:top]:
            print(f"    {ns / total:6.1%} {ns / 1e3:9.0f} us  {kinds[op]:<15} {op:<32} {sources.get(op, '')}")
    return {"program": name, "op_ms_per_run": total / 1e6, "shares": {k: by_kind[k] / total for k in KINDS},
            "top": [(op, ns / total, kinds[op], sources.get(op, "")) for op, ns in
                    sorted(known.items(), key=lambda item: -item[1])[:top]]}


def profile_training(args) -> list[dict]:
    if not {"update", "logprobs"} & set(args.programs):
        return []
    cfg = ModelConfig.w_small()
    learner, batch, holder = training_programs(cfg)

    def update():
        holder["state"], metrics = learner.update(holder["state"], batch)
        return metrics

    results = []
    if "update" in args.programs:
        update()
        kinds, sources = op_kinds(learner.lower_update(holder["state"], batch).compile().as_text())
        times, wall = traced_ops(update, args.runs)
        print(f"update: {wall * 1e3:.0f} ms per run (wall, under the profiler)")
        results.append(breakdown("update", times, kinds, sources, args.runs, args.top))
    if "logprobs" not in args.programs:
        return results
    params = learner.params
    learner.logprobs(params, batch)
    compiled = learner._logprobs.lower(params, batch.tokens, batch.token_mask).compile()
    kinds, sources = op_kinds(compiled.as_text())
    times, wall = traced_ops(lambda: learner.logprobs(params, batch), args.runs)
    print(f"logprobs: {wall * 1e3:.0f} ms per run (wall, under the profiler)")
    results.append(breakdown("logprobs", times, kinds, sources, args.runs, args.top))
    return results


def profile_decode(args) -> list[dict]:
    cfg = ModelConfig.w_small()
    results = []
    graphdef, model_params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (PROMPTS, PROMPT_LEN)).tolist()
    new_tokens = args.new_tokens
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, greedy=args.greedy, ignore_eos=True)
    for layout, cache in (("contiguous", None), ("paged", CacheConfig.paged(page_size=16))):
        if layout not in args.programs:
            continue
        extra = {} if cache is None else {"cache": cache}
        sampler = Sampler(cfg, graphdef, num_slots=PROMPTS * GROUP, max_prompt_len=PROMPT_LEN,
                          max_new_tokens=new_tokens, chunk_steps=16, **extra)
        generate = lambda: sampler.generate(model_params, prompts, sampling, group_size=GROUP,
                                                    key=jax.random.key(1))  # noqa: E731
        generate()
        kinds, sources = {}, {}
        for lowered in sampler.lower_programs(model_params, sampling, group_size=GROUP).values():
            more_kinds, more_sources = op_kinds(lowered.compile().as_text())
            kinds.update(more_kinds)
            sources.update(more_sources)
        times, wall = traced_ops(generate, args.runs)
        print(f"decode ({layout}): {wall * 1e3:.0f} ms per generate (wall, under the profiler)")
        results.append(breakdown(f"decode {layout}, {new_tokens} new tokens", times, kinds, sources, args.runs, args.top,
                                 steps=new_tokens))
    return results


def profile_torch(args) -> dict:
    """torch's self CPU time by op for the same update: forward, GRPO loss, backward, AdamW step."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = ModelConfig.w_small()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
        max_position_embeddings=128)).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    rows, length = PROMPTS * GROUP, PROMPT_LEN + RESPONSE_LEN
    tokens = torch.randint(0, cfg.vocab_size, (rows, length))
    ref, old = torch.randn(rows, RESPONSE_LEN) - 6.2, torch.randn(rows, RESPONSE_LEN) - 6.2
    advantages = torch.randn(rows, 1)

    def step():
        logits = model(tokens).logits[:, PROMPT_LEN - 1:-1]  # TRL: the response positions only
        logprobs = torch.gather(logits.log_softmax(-1), 2, tokens[:, PROMPT_LEN:, None])[..., 0]
        ratio = torch.exp(logprobs - old)
        policy = -torch.min(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
        kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
        loss = (policy + 0.04 * kl).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.runs):
            step()
        wall = (time.perf_counter() - start) / args.runs
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if re.search(r"aten::(mm|addmm|bmm|matmul|linear)$", e.key))
    print(f"torch update (transformers Qwen2, same shapes): {wall * 1e3:.0f} ms per step under the profiler; "
          f"matmuls {matmul / total:.0%} of self CPU time ({torch.get_num_threads()} threads)")
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]
    for e in top:
        print(f"    {e.self_cpu_time_total / total:6.1%} {e.self_cpu_time_total / args.runs:9.0f} us  {e.key}")
    return {"program": "torch update", "ms_per_step": wall * 1e3, "matmul_share": matmul / total,
            "top": [(e.key, e.self_cpu_time_total / total) for e in top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="largest ops to list per program")
    parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    parser.add_argument("--new-tokens", type=int, default=RESPONSE_LEN, help="decode: new tokens per sequence")
    parser.add_argument("--greedy", action="store_true", help="decode: greedy instead of temperature 1")
    parser.add_argument("--json", help="also write the breakdowns here")
    args = parser.parse_args()
    results = profile_training(args) + profile_decode(args)
    if "torch" in args.programs:
        results.append(profile_torch(args))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
