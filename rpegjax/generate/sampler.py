"""The sampler: a host controller over two compiled functions, `admit` (prefill into slots) and `decode`.

Continuous batching (`stream`): a fixed number of slots decode in compiled chunks of `chunk_steps`
steps; between chunks the controller hands out every finished sequence at once and refills free slots
with pending prompts (a prompt's G samples start together from one prefill). A long response therefore
holds one slot, not a whole batch. Static batching (`generate_static`) fills all slots, decodes until
the slowest sequence ends, then starts the next batch: the baseline. Each chunk attends only to the
first `window` cache positions, the longest running row's length plus the chunk rounded up to
`window_step` times a power of two, so attention costs what the sequences need, not the capacity, and
few decode programs compile. After a chunk only the small per-slot arrays and the rows of finished
sequences come back to the host.

The KV cache is contiguous (`CacheLayout.CONTIGUOUS`, `contiguous_sampler.ContiguousController`: every slot
reserves the capacity, the reference) or paged (`CacheLayout.PAGED`, `paged_sampler.PagedController`: memory
follows the tokens in flight). The sampler checks the call and hands it to its layout's controller.

Both paths draw the step-th token of (prompt_index, sample_index) with the same key, so for one key
they return the same sequences, whatever slot or wave a sequence lands in.

The controllers serve `requests.Request`s (a context, a budget, samples sharing one prefill, a PRNG stream):
the call's prompts, and those a `RequestFeed` adds while the stream runs (an episode's next turn after its
tool ran, `rpegjax.envs.rollout`), admitted like prompts; a context may then be longer than max_prompt_len
as long as context + budget fit the capacity.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.generate.completion import Completion
from rpegjax.generate.contiguous_sampler import ContiguousController
from rpegjax.generate.decode import DecodeState, routing_shape
from rpegjax.generate.page_carry import KeptPages
from rpegjax.generate.paged_cache import CacheConfig
from rpegjax.generate.paged_sampler import PagedController
from rpegjax.generate.requests import Request, RequestFeed, check_request
from rpegjax.generate.sampling import SamplingConfig, sampling_arrays
from rpegjax.generate.weight_sync import generation_batch_axes, generation_rules
from rpegjax.models.config import ModelConfig
from rpegjax.models.lora import LoRAConfig
from rpegjax.models.transformer import Decoder
from rpegjax.options import CacheLayout
from rpegjax.sharding import axes
from rpegjax.sharding.rules import (
    ActivationSharding,
    ShardingRules,
    logical_to_spec,
    param_shardings,
)


@dataclasses.dataclass
class SamplerStats:
    """Counters since the sampler was built (mutable on purpose: the controller's bookkeeping)."""

    prefill_calls: int = 0  # compiled admit calls
    prefilled_prompts: int = 0  # prompts run through a prefill (once per prompt, whatever the group size)
    decode_calls: int = 0  # compiled decode calls (chunks)
    decode_steps: int = 0  # decode steps run, summed over calls
    chunks_per_window: dict[int, int] = dataclasses.field(default_factory=dict)  # attention window -> decode calls
    preemptions: int = 0  # paged layout: sequences sent back to pending because their replica's pool ran dry
    peak_pages: int = 0  # paged layout: most pages held at once, over all replicas
    shared_page_references: int = 0  # paged layout: prompt pages a group sample uses without a copy of its own
    # KV memory, time-averaged over decode steps: sum over chunks of steps x tokens the cache reserves
    # (static: slots x capacity; paged: pages held x page size) and x tokens actually cached
    reserved_token_steps: float = 0.0
    cached_token_steps: float = 0.0
    # live buckets: (attention window, bucket rows per slot replica) -> decode calls (one program each), and
    # over decode steps: slots x steps, rows decoded (the buckets) x steps, and the steps of running sequences
    chunks_per_shape: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    slot_steps: int = 0
    decoded_row_steps: int = 0
    live_row_steps: int = 0

    def record_chunk(self, steps: int, *, window: int, bucket: int, rows: int, slots: int, live_tokens: int) -> None:
        """One decode chunk of `steps` steps over `rows` rows (`bucket` per replica) of `slots`, in which the
        running sequences generated `live_tokens` tokens (one per step each while it runs)."""
        self.decode_calls += 1
        self.decode_steps += steps
        self.chunks_per_window[window] = self.chunks_per_window.get(window, 0) + 1
        self.chunks_per_shape[(window, bucket)] = self.chunks_per_shape.get((window, bucket), 0) + 1
        self.slot_steps += steps * slots
        self.decoded_row_steps += steps * rows
        self.live_row_steps += live_tokens

    def slot_occupancy(self) -> float:
        """Share of slot-steps a running sequence used (slot busy %)."""
        return self.live_row_steps / self.slot_steps

    def bucket_occupancy(self) -> float:
        """Share of the decoded rows' steps a running sequence used (1 = no row decoded for nothing)."""
        return self.live_row_steps / self.decoded_row_steps

    def record_memory(self, steps: int, *, reserved: float, cached: float) -> None:
        self.reserved_token_steps += steps * reserved
        self.cached_token_steps += steps * cached

    def reserved_over_cached(self) -> float:
        """Time-averaged KV tokens reserved / tokens cached (1 = no waste)."""
        return self.reserved_token_steps / self.cached_token_steps


def slot_replicas(mesh: Mesh, rules: ShardingRules) -> int:
    """How many ways `rules` split slots (the batch axis) on `mesh`."""
    spec = logical_to_spec((axes.BATCH,), rules.activations, mesh)[0]
    names = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(mesh.shape[name] for name in names)


def usable_slots(requested: int, group_size: int, mesh: Mesh | None, rules: ShardingRules | None = None) -> int:
    """The most slots <= `requested` that hold whole groups and split evenly over the mesh's slot replicas
    (default generation rules); raises when not even one such set fits."""
    if mesh is None:
        replicas = 1
    else:
        replicas = slot_replicas(mesh, generation_rules(batch_axes=generation_batch_axes(mesh)) if rules is None else rules)
    step = math.lcm(group_size, replicas)
    if requested < step:
        raise ValueError(
            f"{requested} slots cannot hold a group of {group_size} on each of {replicas} slot replicas "
            f"(need a multiple of {step})"
        )
    return requested - requested % step


class _CheckedFeed:
    """A `RequestFeed` whose requests pass `check(request, where=...)` (numbered in order of arrival)."""

    def __init__(self, feed: RequestFeed, check):
        self.feed, self.check, self.count = feed, check, 0

    def _checked(self, requests: list[Request]) -> list[Request]:
        checked = []
        for request in requests:
            checked.append(self.check(request, where=f"fed request {self.count}"))
            self.count += 1
        return checked

    def poll(self) -> list[Request]:
        return self._checked(self.feed.poll())

    def wait(self) -> list[Request]:
        return self._checked(self.feed.wait())


def _generation_param_shardings(cfg: ModelConfig, lora: LoRAConfig | None, mesh: Mesh,
                                rules: ShardingRules) -> nnx.State:
    """Where `rules` place every parameter of the model `cfg` (with `lora`'s adapters) on `mesh`."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), lora=lora))
    return param_shardings(nnx.split(abstract)[1], mesh, rules)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"Sampler: {name} must be a positive integer, got {value!r}")
    return int(value)


class Sampler:
    """KV-cache sampler for one model shape, one number of slots and one cache capacity.

    `num_slots` sequences decode together; the cache holds `max_prompt_len + max_new_tokens` tokens
    per slot. With a `mesh`, slots are split over the rules' batch axes, heads over the tensor axis and a
    mixture-of-experts model's experts over the `expert` axis (default rules: `generation_rules` with every mesh
    axis but tensor as a batch axis, so no device
    repeats another's slots; `num_slots` must divide by their product); parameters must already be in that layout
    (`weight_sync.reshard_params`). The compiled functions are built once here, by the layout's controller
    (`contiguous_sampler.ContiguousController` or `paged_sampler.PagedController`); `admit` compiles once
    per (prompt bucket, group size, prefill width: max_prompt_len, or the capacity for a longer fed context),
    `decode` once per (attention window: 2 + log2(capacity / window_step) at most, live bucket). `cache` chooses
    the KV layout (default contiguous; `CacheConfig.paged(...)` for pages). `live_buckets` (default True): each
    decode chunk runs only the running slots of each replica, padded to a power of two (`live_rows`: at most
    1 + log2(slots per replica) buckets); False decodes every slot every step (the baseline of benchmarks).
    `record_routing` (a mixture-of-experts model only; default False): every completion carries the experts each
    sparse layer chose for each of its tokens (`Completion.expert_ids`), for router replay in training; off, the
    programs carry no routing at all.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        *,
        num_slots: int,
        max_prompt_len: int,
        max_new_tokens: int,
        chunk_steps: int = 16,
        window_step: int = 64,
        mesh: Mesh | None = None,
        rules: ShardingRules | None = None,
        cache: CacheConfig | None = None,
        lora: LoRAConfig | None = None,
        live_buckets: bool = True,
        record_routing: bool = False,
    ):
        self.cfg = cfg
        if record_routing:
            routing_shape(cfg)  # raises for a dense model
        self.record_routing = bool(record_routing)
        self.graphdef = graphdef
        self.lora = lora  # the adapters `graphdef`'s model carries (decoded as x W + s (x A) B), if any
        self.num_slots = _positive_int("num_slots", num_slots)
        self.max_prompt_len = _positive_int("max_prompt_len", max_prompt_len)
        self.max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        self.chunk_steps = _positive_int("chunk_steps", chunk_steps)
        self.window_step = _positive_int("window_step", window_step)
        self.capacity = self.max_prompt_len + self.max_new_tokens
        if self.capacity > cfg.max_position_embeddings:
            raise ValueError(
                f"Sampler: max_prompt_len + max_new_tokens = {self.capacity} exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings})"
            )
        self.mesh = mesh
        if rules is None and mesh is not None:
            rules = generation_rules(batch_axes=generation_batch_axes(mesh))
        self.rules = rules
        self.replicas = 1 if mesh is None else slot_replicas(mesh, rules)
        if self.num_slots % self.replicas:
            raise ValueError(
                f"Sampler: num_slots={self.num_slots} does not split over the {self.replicas} slot replicas of mesh "
                f"{dict(mesh.shape)}; use a multiple of {self.replicas} (see rpegjax.generate.usable_slots)"
            )
        self.stats = SamplerStats()
        self.cache = CacheConfig() if cache is None else cache
        if not isinstance(self.cache, CacheConfig):
            raise TypeError(f"Sampler: cache must be a CacheConfig, got {type(self.cache).__name__}")
        self.params_sharding = None if mesh is None else _generation_param_shardings(cfg, lora, mesh, self.rules)
        activation = None if mesh is None else ActivationSharding(mesh, self.rules)
        common = dict(num_slots=self.num_slots, replicas=self.replicas, max_new_tokens=self.max_new_tokens,
                      chunk_steps=self.chunk_steps, stats=self.stats, mesh=mesh, activation=activation,
                      params_sharding=self.params_sharding, live_buckets=bool(live_buckets),
                      record_routing=self.record_routing)
        # the layout's compiled programs and host loop; `paged` is the paged layout's controller, else None
        self.controller: ContiguousController | PagedController
        self.paged: PagedController | None = None
        if self.cache.layout == CacheLayout.PAGED:
            self.paged = self.controller = PagedController(cfg, graphdef, self.cache, capacity=self.capacity, **common)
        else:
            self.controller = ContiguousController(cfg, graphdef, max_prompt_len=self.max_prompt_len,
                                                   window_step=self.window_step, **common)

    def compile_counts(self) -> dict[str, int]:
        """Programs compiled so far: `admit` one per (prompt bucket, group size, prefill width, sampling switches),
        `decode` one per (attention window, live bucket, sampling switches); anything more is a retrace bug.
        Paged layout: `prefill` per (prompt rows, chunk, page window), `start` per row bucket, `decode` per
        (page window, live bucket), both powers of two."""
        return self.controller.compile_counts()

    def new_state(self) -> DecodeState:
        """All slots empty, placed with the sampler's shardings."""
        return self.controller.new_state()

    # ---- lowering ahead of time ----------------------------------------------------------------------
    def abstract_state(self) -> DecodeState:
        """The decode state's shapes and dtypes with the sampler's shardings (nothing allocated)."""
        return self.controller.abstract_state()

    def _abstract_key(self) -> jax.ShapeDtypeStruct:
        key = jax.eval_shape(lambda: jax.random.key(0))
        replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)

    def lower_programs(self, params: nnx.State, sampling: SamplingConfig, *, group_size: int,
                       long_contexts: bool = False) -> dict[str, jax.stages.Lowered]:
        """Every program generation launches, lowered at the largest shapes a run of `sampling` with groups of
        `group_size` reaches (`params` in the generation layout, may be abstract; nothing is allocated).
        Contiguous cache: `prefill` (every group's prompts at once, max_prompt_len wide) and `decode` (a chunk
        attending to the whole capacity). Paged cache: `prefill` (one chunk of the longest prompts, every slot
        replica's groups), `start` and `decode` (a chunk over every page of a sequence). `long_contexts`: fed
        requests (an episode's later turns) may be longer than max_prompt_len, up to the capacity."""
        arrays = sampling_arrays(sampling, vocab_size=self.cfg.vocab_size, default_eos_id=self.cfg.eos_token_id)
        key, state = self._abstract_key(), self.abstract_state()
        longest = self.capacity if long_contexts else self.max_prompt_len
        return self.controller.lower_programs(params, state, key, arrays, max_prompt_len=longest,
                                              group_size=group_size)

    def lower_kept_retag(self) -> jax.stages.Lowered:
        """The program partial rollouts with kept pages run when a call continues kept sequences
        (`rpegjax.generate.page_carry`: their rows take new PRNG streams), at its largest shape (paged cache only)."""
        if self.paged is None:
            raise ValueError("Sampler.lower_kept_retag: kept KV pages need the paged cache; this sampler's is "
                             "contiguous")
        return self.paged.lower_retag(self.abstract_state())

    def _check_params(self, params: nnx.State) -> None:
        """On a mesh, parameters must already be in the generation layout (moving them is weight sync's job)."""
        if self.params_sharding is None:
            return
        for (path, variable), (_, wanted) in zip(nnx.to_flat_state(params), nnx.to_flat_state(self.params_sharding),
                                                 strict=True):
            value, wanted = variable.get_value(), wanted.get_value()
            have = getattr(value, "sharding", None)
            if have is None or not have.is_equivalent_to(wanted, value.ndim):
                raise ValueError(
                    f"parameter {'/'.join(map(str, path))} is placed as {have}, not in the sampler's layout {wanted}; "
                    "move parameters with rpegjax.generate.reshard_params(state, sampler.mesh, sampler.rules)"
                )

    def _prepare(self, params, prompts, sampling, group_size, budgets, key):
        self._check_params(params)
        checked = _checked_prompts(self, prompts, sampling, group_size, budgets)
        arrays = sampling_arrays(sampling, vocab_size=self.cfg.vocab_size, default_eos_id=self.cfg.eos_token_id)
        budgets = [sampling.max_new_tokens] * len(checked) if budgets is None else [int(b) for b in budgets]
        if not isinstance(key, jax.Array):
            raise TypeError(f"key must be a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__}")
        requests = [Request(tokens=ids, budget=budget, samples=group_size, key_index=index)
                    for index, (ids, budget) in enumerate(zip(checked, budgets, strict=True))]
        return requests, arrays

    def _max_samples(self) -> int:
        return self.num_slots if self.paged is None else self.num_slots // self.replicas

    def _checked_feed(self, feed: RequestFeed, sampling: SamplingConfig) -> RequestFeed:
        """`feed` whose requests are checked against this sampler as they arrive."""
        return _CheckedFeed(feed, partial(check_request, vocab_size=self.cfg.vocab_size, capacity=self.capacity,
                                          max_new_tokens=sampling.max_new_tokens, max_samples=self._max_samples()))

    # ---- public API --------------------------------------------------------------------------------
    def stream(
        self,
        params: nnx.State,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        group_size: int = 1,
        key: jax.Array,
        version: int | None = None,
        budgets: Sequence[int] | None = None,
        feed: RequestFeed | None = None,
        stats: SamplerStats | None = None,
    ) -> Iterator[Completion]:
        """Continuous batching: yields each Completion as soon as the chunk it finished in ends.

        `budgets` optionally caps the new tokens of each prompt (<= sampling.max_new_tokens).
        `version` (the weights' version) is copied into every Completion. Inputs are checked here, at
        the call, not at the first `next`. `feed` (`generate.requests`) adds requests while the stream runs
        (e.g. multi-turn episodes); their completions carry `prompt_index` = len(prompts) + their order of
        arrival, `sample_index` = the sample within the request, and the request's context as `prompt_ids`.
        `stats`: a `SamplerStats` that also counts this call's decode chunks (the sampler's own count every call:
        one caller's occupancy, while another thread uses the sampler, needs its own).
        """
        requests, arrays = self._prepare(params, prompts, sampling, group_size, budgets, key)
        feed = None if feed is None else self._checked_feed(feed, sampling)
        return self.controller.run(params, requests, arrays, key, version, continuous=True, feed=feed, tally=stats)

    def serve(self, params: nnx.State, requests: Sequence[Request], sampling: SamplingConfig, *, key: jax.Array,
              version: int | None = None, interrupt: Callable[[], bool] | None = None,
              stats: SamplerStats | None = None, keep: KeptPages | None = None) -> Iterator[Completion]:
        """Continuous batching of prepared `requests` (a context may be longer than max_prompt_len when context +
        budget fit the capacity: a continued sequence). Completion i's `prompt_index` is its request's position.
        `interrupt()` is asked before each decode chunk: once True, every sequence still running or waiting is
        handed out as a `FinishReason.PARTIAL` completion holding its tokens so far, and the stream ends. `stats`:
        as `stream`'s. `keep` (paged cache only): the sequences an interruption hands out keep their KV pages
        there, and a later call's requests naming their slots (`Request.kept`) continue them unprefilled
        (`rpegjax.generate.page_carry`)."""
        if keep is not None and self.paged is None:
            raise ValueError("Sampler.serve(keep=...): kept KV pages need the paged cache (CacheConfig.paged(...)); "
                             "this sampler's cache is contiguous")
        self._check_params(params)
        _check_sampling(self, sampling)
        if not isinstance(key, jax.Array):
            raise TypeError(f"key must be a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__}")
        check = partial(check_request, vocab_size=self.cfg.vocab_size, capacity=self.capacity,
                        max_new_tokens=sampling.max_new_tokens, max_samples=self._max_samples())
        checked = [check(request, where=f"request {index}") for index, request in enumerate(requests)]
        if not checked:
            raise ValueError("Sampler.serve needs at least one request, got none")
        arrays = sampling_arrays(sampling, vocab_size=self.cfg.vocab_size, default_eos_id=self.cfg.eos_token_id)
        if keep is None:
            return self.controller.run(params, checked, arrays, key, version, continuous=True, interrupt=interrupt,
                                       tally=stats)
        return self.paged.run(params, checked, arrays, key, version, continuous=True, interrupt=interrupt, tally=stats,
                              keep=keep)

    def generate(self, params: nnx.State, prompts, sampling: SamplingConfig, *, group_size: int = 1,
                 key: jax.Array, version: int | None = None, budgets=None) -> list[Completion]:
        """All completions of `stream`, ordered by (prompt_index, sample_index)."""
        completions = self.stream(params, prompts, sampling, group_size=group_size, key=key, version=version,
                                  budgets=budgets)
        return sorted(completions, key=lambda c: c.order)

    def generate_static(self, params: nnx.State, prompts, sampling: SamplingConfig, *, group_size: int = 1,
                        key: jax.Array, version: int | None = None, budgets=None) -> list[Completion]:
        """Static batching: fill the slots, decode until all are done, repeat; ordered like `generate`."""
        requests, arrays = self._prepare(params, prompts, sampling, group_size, budgets, key)
        completions = self.controller.run(params, requests, arrays, key, version, continuous=False)
        return sorted(completions, key=lambda c: c.order)


def _check_sampling(sampler: Sampler, sampling: SamplingConfig) -> None:
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if sampling.max_new_tokens > sampler.max_new_tokens:
        raise ValueError(
            f"SamplingConfig.max_new_tokens={sampling.max_new_tokens} exceeds the sampler's "
            f"max_new_tokens={sampler.max_new_tokens} (its cache capacity)"
        )


def _checked_prompts(sampler: Sampler, prompts, sampling: SamplingConfig, group_size: int, budgets) -> list[np.ndarray]:
    """`prompts` as int32 arrays, checked against the sampler's limits, the sampling config and `budgets`."""
    _check_sampling(sampler, sampling)
    group_size = _positive_int("group_size", group_size)
    if group_size > sampler.num_slots:
        raise ValueError(f"group_size={group_size} exceeds num_slots={sampler.num_slots}: a group must fit at once")
    if sampler.paged is not None and group_size > sampler.num_slots // sampler.replicas:
        raise ValueError(f"group_size={group_size} exceeds the {sampler.num_slots // sampler.replicas} slots of one replica: "
                         "a group shares its prompt pages, so it must fit in one replica")
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    checked = []
    for index, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt {index} is empty or not a flat list of token ids (shape {ids.shape})")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt {index} holds non-integer token ids (dtype {ids.dtype})")
        if ids.size > sampler.max_prompt_len:
            raise ValueError(
                f"prompt {index} has {ids.size} tokens, more than the sampler's max_prompt_len={sampler.max_prompt_len}"
            )
        if ids.min() < 0 or ids.max() >= sampler.cfg.vocab_size:
            raise ValueError(f"prompt {index} has token ids outside [0, {sampler.cfg.vocab_size})")
        checked.append(ids.astype(np.int32))
    if budgets is not None:
        if len(budgets) != len(prompts):
            raise ValueError(f"budgets has {len(budgets)} entries for {len(prompts)} prompts")
        for index, budget in enumerate(budgets):
            if isinstance(budget, bool) or not isinstance(budget, int | np.integer) or not 1 <= budget <= sampling.max_new_tokens:
                raise ValueError(
                    f"budgets[{index}] must be an integer in [1, max_new_tokens={sampling.max_new_tokens}], got {budget!r}"
                )
    return checked
