"""Per-device memory of one decode chunk of a Qwen2.5-7B-shaped model, compiled ahead of time on 8 virtual
CPU devices (nothing is allocated: every input is a `jax.ShapeDtypeStruct`), static vs paged KV cache.

    python benchmarks/bench_generate_memory.py [--slots 64] [--mesh data=2,tensor=4] [--layers 2]

Load like W-plan (shared/WORKLOADS.md): prompts of 1k tokens, responses log-normal with mean 4k and max 16k
tokens. The static layout reserves prompt + max response per slot; the paged pool holds
--pool-tokens-per-slot tokens per slot (default prompt + 1.25 x mean), pages of --page-size. The decode chunk
attends over the longest sequence's pages (a 16k response in flight). Prints argument, output and temporary
bytes per device from `compiled.memory_analysis()` and compile seconds.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from rpegjax.generate import Sampler, SamplingConfig  # noqa: E402
from rpegjax.generate.paged_cache import CacheConfig, kv_bytes_per_token, pages_for  # noqa: E402
from rpegjax.models import Decoder, ModelConfig  # noqa: E402
from rpegjax.sharding import make_mesh, parse_mesh  # noqa: E402

GIB = 2**30


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _report(name: str, lower) -> None:
    start = time.perf_counter()
    compiled = lower().compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    print(f"  {name:>28}: arguments {memory.argument_size_in_bytes / GIB:7.2f} GiB, outputs "
          f"{memory.output_size_in_bytes / GIB:7.2f} GiB, temporaries {memory.temp_size_in_bytes / GIB:7.2f} GiB, "
          f"aliased {memory.alias_size_in_bytes / GIB:7.2f} GiB per device; compiled in {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--mesh", default="data=2,tensor=4")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--mean", type=int, default=4096)
    parser.add_argument("--max-response", type=int, default=16384)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--pool-tokens-per-slot", type=int, default=None)
    parser.add_argument("--chunk-steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None,
                        help="compile this many layers of the 7B shape (default all 28): temporaries per layer")
    args = parser.parse_args()

    cfg = ModelConfig.qwen2p5("7b")
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    mesh = make_mesh(parse_mesh(args.mesh))
    graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    pool_tokens = args.pool_tokens_per_slot or args.prompt + int(1.25 * args.mean)
    shape = dict(num_slots=args.slots, max_prompt_len=args.prompt, max_new_tokens=args.max_response,
                 chunk_steps=args.chunk_steps, mesh=mesh)
    print(f"Qwen2.5-7B shape ({cfg.num_layers} layers), bf16, mesh {dict(mesh.shape)}, {args.slots} slots; prompt "
          f"{args.prompt}, responses mean {args.mean} max {args.max_response}; {kv_bytes_per_token(cfg)} KV bytes per "
          "token (all devices)")
    sampling = SamplingConfig(max_new_tokens=args.max_response, temperature=1.0)

    # the decode chunk exactly as the sampler runs it (and the dry run compiles it): the whole capacity attended,
    # every slot in the bucket
    static = Sampler(cfg, graphdef, **shape)
    print(f"  static cache: {args.slots} x {static.capacity} tokens reserved")
    _report("static layout, full window", lambda: _decode(static, abstract_params, sampling))

    pages = pages_for(pool_tokens * (args.slots // static.replicas), args.page_size)
    paged = Sampler(cfg, graphdef, **shape, cache=CacheConfig.paged(page_size=args.page_size, pages_per_replica=pages))
    print(f"  paged pool: {pages} pages of {args.page_size} per replica x {paged.replicas} replicas "
          f"= {pool_tokens} tokens per slot")
    # a max-length response in flight: every page-table column gathered
    _report("paged, full page window", lambda: _decode(paged, abstract_params, sampling))


def _decode(sampler: Sampler, abstract_params, sampling: SamplingConfig) -> jax.stages.Lowered:
    """The sampler's decode chunk lowered at its largest shape (`Sampler.lower_programs`), parameters abstract in
    the generation layout."""
    params = _abstract(abstract_params, sampler.params_sharding)
    return sampler.lower_programs(params, sampling, group_size=1)["decode"]


if __name__ == "__main__":
    main()
