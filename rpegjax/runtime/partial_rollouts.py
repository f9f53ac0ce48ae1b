"""Partial rollouts: generation keeps more groups in flight than a step trains, a step takes the first groups that
complete, and the sequences still decoding carry over into the next step's generation, with its newer weights.

Each step's generation serves every group in flight (`PartialRolloutConfig.inflight_batches` batches of prompts:
the groups carried over, topped up with new prompts) and is interrupted between decode chunks
(`Sampler.serve(interrupt=...)`) as soon as the step's batch of complete groups is there; the sequences still
running come back as prefixes (`FinishReason.PARTIAL`). How a carried sequence continues is `CarryMode`:
- `recompute`: a request of context prompt + prefix, prefilled with the new weights. The log-prob recorded for
  every token is then exactly that of a full forward under the weights version that sampled it
  (`Completion.token_versions`). The price is one prefill of the context per carry.
- `pages` (paged cache): its KV pages stay in the sampler's pool across the step (`generate.page_carry`) and it
  decodes on with the new weights, unprefilled. The cache then holds keys and values of older weights: a token's
  recorded log-prob is that of a decode that built the cache token by token, each position with the version
  that read it (the one that sampled the next token), not a full forward under one version. The pool stays
  allocated through the training step (colocated), and a checkpoint holds tokens, not pages: a resumed run
  continues its carried sequences by recomputing them once (`restore`).

Staleness is bounded per token: a group trained at step t has all its tokens of versions >= t - `max_token_lag`.
New tokens of step t are of version t - k (asynchrony bound k), so a group may be carried until its oldest token
would lag more. A group that cannot be carried once more is *due*: with `StalePolicy.WAIT` the step's generation
is not interrupted before every due group has completed, and due groups come first in the batch; with
`StalePolicy.DROP` the step takes its batch as soon as it can and the due groups that did not make it are
dropped. Either way no group is ever trained beyond the bound (with WAIT only when more groups are due than a
batch holds, which a bound of one carry and two batches in flight never reaches, are the extra ones dropped).

Every request's PRNG stream is its position in the step's call under `fold_in(key, step)`, and the order of the
groups is deterministic, so a run's batches do not depend on thread timing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rpegjax.data.example import Example
from rpegjax.generate.completion import Completion, FinishReason
from rpegjax.generate.page_carry import KeptPages
from rpegjax.generate.requests import Request
from rpegjax.generate.sampler import Sampler, SamplerStats
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.options import CarryMode

__all__ = ["CarryMode", "Group", "PartialRolloutConfig", "PartialRollouts", "StalePolicy"]


class StalePolicy(enum.StrEnum):
    WAIT = "wait"  # a step's generation waits for the groups that cannot be carried further
    DROP = "drop"  # those groups are dropped when the step's batch is full without them


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartialRolloutConfig:
    """`max_token_lag`: the most weights versions a trained token may lag the trainer (step t trains tokens of
    versions >= t - max_token_lag; it must exceed the asynchrony bound k, whose new tokens lag by k).
    `inflight_batches`: groups kept in flight, in batches of a step's prompts (>= 2: a step stops when one
    batch has completed, while the others keep decoding). `inflight_weights`: a step's generation takes newer
    weights versions between decode chunks, without dropping a sequence, not only at the next step. When is
    `inflight_after`:
    - a share f in (0, 1]: once f of the groups its batch still lacked when it began have completed, the step takes
      the next version (once a step), waiting for it if the trainer has not published it yet. The switch point
      depends on the tokens only, so runs are reproducible, threaded or inline, and a resume continues exactly;
      and it is a point in the step's generation whatever its length (at scale, where the update ends long
      before, nothing waits).
    - None: each version as soon as it is published. No wait, but the batches depend on the trainer's timing:
      not reproducible run to run, nor after a resume (which still loses and repeats no prompt).
    `carry`: how carried sequences continue (`CarryMode`)."""

    max_token_lag: int
    stale_policy: StalePolicy = StalePolicy.WAIT
    inflight_batches: int = 2
    inflight_weights: bool = False
    inflight_after: float | None = 0.5
    carry: CarryMode = CarryMode.RECOMPUTE

    def __post_init__(self) -> None:
        for name, least in (("max_token_lag", 1), ("inflight_batches", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"PartialRolloutConfig.{name} must be an integer >= {least}, got {value!r}")
        share = self.inflight_after
        if share is not None and (isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1):
            raise ValueError(f"PartialRolloutConfig.inflight_after must be a share in (0, 1] or None, got {share!r}")
        object.__setattr__(self, "stale_policy", StalePolicy(self.stale_policy))
        object.__setattr__(self, "carry", CarryMode(self.carry))


@dataclasses.dataclass
class _Sample:
    """One sequence of a group: its response so far, with the log-prob and weights version of every token."""

    tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.int32))
    logprobs: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.float32))
    versions: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.int64))
    finish: FinishReason | None = None
    kept: int | None = None  # carry=pages: the sampler slot keeping its pages (None: recomputed if continued)

    def extend(self, completion: Completion, version: int) -> None:
        self.tokens = np.concatenate([self.tokens, completion.response_ids.astype(np.int32)])
        self.logprobs = np.concatenate([self.logprobs, completion.behaviour_logprobs.astype(np.float32)])
        self.versions = np.concatenate([self.versions, np.full((completion.length,), version, np.int64)])
        self.finish = None if completion.finish_reason == FinishReason.PARTIAL else completion.finish_reason


@dataclasses.dataclass(eq=False)
class Group:
    """One prompt's group of samples in flight."""

    example: Example
    prompt: np.ndarray  # int32 [s]
    samples: list[_Sample]

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def oldest(self) -> int | None:
        """The oldest weights version of its tokens (None: none sampled yet)."""
        versions = [int(s.versions.min()) for s in self.samples if len(s.versions)]
        return min(versions) if versions else None

    def completions(self, prompt_index: int, version: int) -> list[Completion]:
        """Its finished samples as completions (`prompt_index`: its row block in the batch)."""
        return [Completion(prompt_index=prompt_index, sample_index=j, prompt_ids=self.prompt.copy(),
                           response_ids=s.tokens.copy(), behaviour_logprobs=s.logprobs.copy(), finish_reason=s.finish,
                           version=version, token_versions=s.versions.copy()) for j, s in enumerate(self.samples)]


class PartialRollouts:
    """The groups in flight across steps (host state of the rollout thread) and one step's generation over them.

    `sampler` generates with `sampling`, `group_size` samples per prompt; a step trains `batch_size` groups; new
    tokens of step t are of version t - `async_bound`."""

    def __init__(self, config: PartialRolloutConfig, *, sampler: Sampler, sampling: SamplingConfig, group_size: int,
                 batch_size: int, async_bound: int):
        if config.max_token_lag <= async_bound:
            raise ValueError(f"partial rollouts: max_token_lag={config.max_token_lag} must exceed the asynchrony "
                             f"bound {async_bound} (new tokens already lag by it), or no sequence could be carried")
        self.config = config
        self.sampler = sampler
        self.sampling = sampling
        self.group_size = group_size
        self.batch_size = batch_size
        self.pool: list[Group] = []
        self.pages = _kept_pages(config, sampler)
        self._index: tuple[Sequence[Example], int, dict[Example, int]] | None = None  # `snapshot`'s, per data set

    @property
    def capacity(self) -> int:
        """The most groups in flight (a snapshot holds at most that many)."""
        return self.config.inflight_batches * self.batch_size

    def fill(self, take_batch: Callable[[], list[Example]],
             prompt_ids: Callable[[Sequence[Example]], list[list[int]]]) -> None:
        """Tops the groups in flight up to `inflight_batches` batches with new prompts, a batch at a time."""
        while len(self.pool) < self.config.inflight_batches * self.batch_size:
            examples = take_batch()
            for example, ids in zip(examples, prompt_ids(examples), strict=True):
                self.pool.append(Group(example=example, prompt=np.asarray(ids, np.int32),
                                       samples=[_Sample() for _ in range(self.group_size)]))

    def _due(self, step: int) -> list[Group]:
        """The groups that cannot be carried past step `step`: trained later, a token would lag too much."""
        return [g for g in self.pool if (o := g.oldest()) is not None and step + 1 - o > self.config.max_token_lag]

    def _requests(self) -> tuple[list[Request], list[tuple[Group, list[int]]]]:
        """The requests continuing every unfinished sample, and whose samples each one serves. An untouched group
        is one request (its samples share a prefill); a started sample continues from prompt + its tokens."""
        requests, owners = [], []
        budget = self.sampling.max_new_tokens
        for group in self.pool:
            unfinished = [j for j, s in enumerate(group.samples) if s.finish is None]
            if not unfinished:
                continue
            if group.oldest() is None and len(unfinished) == len(group.samples):
                requests.append(Request(tokens=group.prompt, budget=budget, samples=len(unfinished),
                                        key_index=len(requests)))
                owners.append((group, unfinished))
                continue
            for j in unfinished:
                sample = group.samples[j]
                requests.append(Request(tokens=np.concatenate([group.prompt, sample.tokens]),
                                        budget=budget - len(sample.tokens), key_index=len(requests),
                                        kept=sample.kept if len(sample.tokens) else None))
                owners.append((group, [j]))
        return requests, owners

    def run_step(self, step: int, version: int, params: Any, key: jax.Array,
                 newer: Callable[[int], tuple[int, Any] | None] | None = None,
                 stats: SamplerStats | None = None,
                 fetch: Callable[[int], Any] | None = None) -> tuple[list[Group], dict[str, float]]:
        """Generates over the groups in flight with weights `version` until step `step`'s batch is complete;
        returns the batch's groups (due ones first, then in order of completion) and the step's metrics.

        Weights in flight (`inflight_weights`), asked between decode chunks: `newer(v)` gives a newer version than
        v and its weights, or None, never waiting (`inflight_after` None); `fetch(v)` gives version v's weights,
        waiting for them (`inflight_after` a share). The sequences running are then handed back and continue at
        once with the newer weights, the call's next segment drawing with `fold_in(key, segment)`. `stats` counts
        its decode chunks."""
        due = self._due(step) if self.config.stale_policy == StalePolicy.WAIT else []
        completed = [g for g in self.pool if g.complete]
        first_version = version
        batch = self.batch_size
        at_start = len(completed)  # the step then lacks batch - at_start groups

        def enough() -> bool:
            return len(completed) >= batch and all(g.complete for g in due)

        segments, continued = 0, {"kept": 0, "recomputed": 0}
        while True:
            update: list[tuple[int, Any]] = []

            def interrupt(switches: int = segments) -> bool:
                if enough():
                    return True
                found = self._in_flight(step, version, switches, (len(completed) - at_start, batch - at_start),
                                        newer, fetch)
                update.extend([found] if found is not None else [])
                return found is not None

            requests, owners = self._requests()
            if not requests or enough():
                break
            for request, (group, _) in zip(requests, owners, strict=True):
                if request.size > len(group.prompt):  # a started sample's continuation
                    continued["kept" if request.kept is not None else "recomputed"] += 1
            draw = jax.random.fold_in(key, segments) if segments else key
            served = []
            for completion in self.sampler.serve(params, requests, self.sampling, key=draw, version=version,
                                                 interrupt=interrupt, stats=stats, keep=self.pages):
                group, samples = owners[completion.prompt_index]
                group.samples[samples[completion.sample_index]].extend(completion, version)
                served.append((completion, group.samples[samples[completion.sample_index]]))
                if completion.finish_reason != FinishReason.PARTIAL and group.complete:
                    completed.append(group)
            for completion, sample in served:  # after the call: an interruption keeps its slots at its end
                sample.kept = (None if self.pages is None or sample.finish is not None
                               else self.pages.slot_of(completion.prompt_index, completion.sample_index))
            if not update:
                break
            (version, params), segments = update[0], segments + 1
        due_ids = {id(g) for g in due}
        ordered = [g for g in completed if id(g) in due_ids] + [g for g in completed if id(g) not in due_ids]
        if len(ordered) < batch:
            raise RuntimeError(f"step {step}: {len(ordered)} complete groups for a batch of {batch} after every "
                               "sequence in flight was served (a bug in the partial rollouts' bookkeeping)")
        chosen = {id(g) for g in ordered[:batch]}
        remaining = [g for g in self.pool if id(g) not in chosen]
        self.pool = [g for g in remaining if (o := g.oldest()) is None or step + 1 - o <= self.config.max_token_lag]
        metrics = self._metrics(ordered[:batch], first_version, dropped=len(remaining) - len(self.pool))
        metrics["partial/weight_updates_in_flight"] = float(segments)
        metrics["partial/kept_sequences"] = float(continued["kept"])
        metrics["partial/recomputed_sequences"] = float(continued["recomputed"])
        return ordered[:batch], metrics

    def _in_flight(self, step: int, version: int, switches: int, progress: tuple[int, int], newer, fetch
                   ) -> tuple[int, Any] | None:
        """The newer weights step `step`'s generation takes now (see `run_step`), or None. `switches`: how many it
        took so far; `progress`: (groups completed since it began, groups its batch then lacked)."""
        config = self.config
        if not config.inflight_weights or version >= step:
            return None
        if config.inflight_after is None:
            return newer(version) if newer is not None else None
        done, lacking = progress
        if fetch is None or switches or done < config.inflight_after * lacking:
            return None
        return version + 1, fetch(version + 1)

    # ---- resume ------------------------------------------------------------------------------------
    def snapshot(self, examples: Sequence[Example]) -> dict[str, Any]:
        """The groups in flight as JSON-able data (a checkpoint's): each group's example as its index in
        `examples` (the data set), its prompt and its samples' tokens, log-probs, versions and finish."""
        index = self._example_index(examples)
        return {"groups": [{"example": index[g.example], "prompt": g.prompt.tolist(), "samples": [
            {"tokens": s.tokens.tolist(), "logprobs": s.logprobs.tolist(), "versions": s.versions.tolist(),
             "finish": None if s.finish is None else s.finish.value} for s in g.samples]} for g in self.pool]}

    def _example_index(self, examples: Sequence[Example]) -> dict[Example, int]:
        """Each example's first position in `examples`, built once per data set (a step's snapshot would otherwise
        hash the whole data set: 15 ms a step for the job's 8,000 problems on the loaded CPU)."""
        if self._index is None or self._index[0] is not examples or self._index[1] != len(examples):
            index: dict[Example, int] = {}
            for i, example in enumerate(examples):
                index.setdefault(example, i)
            self._index = (examples, len(examples), index)
        return self._index[2]

    def restore(self, snapshot: dict[str, Any], examples: Sequence[Example]) -> None:
        """The groups in flight of `snapshot` (from `snapshot`); float32 log-probs round-trip exactly. A snapshot
        holds no KV pages: with carry=pages the restored sequences continue by a recompute of their contexts
        (once; they keep their pages after), and the pages this object kept are freed."""
        if self.pages is not None:
            self.pages.take()
        self.pool = [Group(example=examples[g["example"]], prompt=np.asarray(g["prompt"], np.int32), samples=[
            _Sample(tokens=np.asarray(s["tokens"], np.int32).reshape(-1),
                    logprobs=np.asarray(s["logprobs"], np.float32).reshape(-1),
                    versions=np.asarray(s["versions"], np.int64).reshape(-1),
                    finish=None if s["finish"] is None else FinishReason(s["finish"])) for s in g["samples"]])
            for g in snapshot["groups"]]

    def _metrics(self, groups: list[Group], version: int, *, dropped: int) -> dict[str, float]:
        """Carried: sampled before this step's generation began (with versions older than its first, `version`)."""
        carried = [s for g in groups for s in g.samples if len(s.versions) and s.versions.min() < version]
        return {"partial/carried_groups": float(len(self.pool)),
                "partial/dropped_groups": float(dropped),
                "partial/carried_sequences": float(len(carried)),
                "partial/carried_tokens": float(sum(int((s.versions < version).sum()) for s in carried))}


def _kept_pages(config: PartialRolloutConfig, sampler: Sampler) -> KeptPages | None:
    """carry=pages: where the sampler keeps carried sequences' pages. Refused without a paged cache, or with a pool
    that can run dry: a preempted kept sequence would restart from a recompute of its context, which mixes the
    two carries' log-probs in one sequence."""
    if config.carry != CarryMode.PAGES:
        return None
    paged = sampler.paged
    if paged is None:
        raise ValueError("partial rollouts with carry=pages (rollout.partial_carry) keep KV pages in the paged "
                         "pool: the sampler's cache is contiguous; set the paged cache (rollout.kv_cache=paged) or "
                         "carry=recompute")
    if paged.pages_per_replica < paged.slots_per_replica * paged.max_pages:
        raise ValueError(f"partial rollouts with carry=pages: the paged pool ({paged.pages_per_replica} pages a "
                         f"replica) must hold every slot at full capacity ({paged.slots_per_replica} slots x "
                         f"{paged.max_pages} pages), or a kept sequence could be preempted and recomputed")
    return KeptPages()
