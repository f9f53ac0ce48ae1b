"""The rollout side of a step's programs: generation streamed in pieces of whole prompt groups, each packed
into a fixed-shape batch with its reward scoring submitted at once, and the rewards gathered over processes.

The compiled generation programs are the sampler's (`rpegjax.generate.sampler`, which lowers them itself for
the dry run); this module drives them and turns completions into training rows.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from rpegjax import distributed
from rpegjax.data.example import Example
from rpegjax.envs.rollout import Episode, EpisodeRunner
from rpegjax.generate.completion import Completion
from rpegjax.generate.sampler import Sampler, SamplerStats
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.learners.batch import TrainBatch, pack_rollouts
from rpegjax.rewards.runner import RewardFn, RewardRunner, RewardStats, TermStats


@dataclasses.dataclass(frozen=True)
class Piece:
    """A finished part of one step's rollout: whole groups of completions, packed, with their rewards pending."""

    index: int
    examples: list[Example]  # one per row (each prompt's example repeated group_size times)
    completions: list[Completion]  # ordered by (prompt_index, sample_index)
    batch: TrainBatch  # numpy arrays of a fixed shape
    # (rewards float32 [rows of this process], RewardStats): each process scores its block of the rows
    # (`process_rows`); `RolloutPrograms.collect_rewards` gathers all of them
    rewards: concurrent.futures.Future


class RolloutPrograms:
    """A step's rollout: `sampler` generates `group_size` samples per prompt with `sampling`; `decode` turns
    response ids into text for the rewards, `pad_id` pads the packed rows to the sampler's capacity.

    `rewards` is a `RewardRunner`, or any reward function `fn(completion: str, example) -> float`, which is
    then run by a `RewardRunner` of default settings (worker processes, timeouts, limits) that these
    programs own: `close()` stops it (None: programs that never generate, as in tests of other stages).

    `episodes` makes every rollout multi-turn (`rpegjax.envs.rollout`): each sample is an episode of model turns
    and tool outputs (masked out of the loss), rendered from the environment's opening messages (the `prompt_ids`
    passed to `generate` are then unused); the reward reads the last model turn, and an environment's own
    reward, when it gives one, replaces the task's.
    """

    def __init__(self, *, sampler: Sampler, sampling: SamplingConfig, group_size: int,
                 rewards: RewardRunner | RewardFn | None, decode: Callable[[Sequence[int]], str], pad_id: int,
                 episodes: EpisodeRunner | None = None):
        if episodes is not None and episodes.sampler is not sampler:
            raise ValueError("RolloutPrograms: the episode runner must drive this programs' sampler")
        self.episodes = episodes
        self.sampler = sampler
        self.sampling = sampling
        self.group_size = group_size
        self._own_rewards = rewards is not None and not isinstance(rewards, RewardRunner)
        self.rewards = RewardRunner(rewards) if self._own_rewards else rewards
        self.decode = decode
        self.pad_id = pad_id
        self.sequence_length = sampler.max_prompt_len + sampler.max_new_tokens
        self.reward_processes: Sequence[int] | None = None  # who scores a piece's rows (None: every process)

    def close(self) -> None:
        """Stops the reward runner these programs made from a reward function (a runner passed in is the
        caller's to close)."""
        if self._own_rewards:
            self.rewards.close()

    def generate(
        self,
        params: Any,
        examples: Sequence[Example],
        prompt_ids: Sequence[Sequence[int]],
        *,
        key: jax.Array,
        version: int,
        pieces: int,
        stats: SamplerStats | None = None,
    ) -> Iterator[Piece]:
        """Streams the step's rollout in `pieces` parts of whole prompt groups, each yielded (with its reward
        scoring already submitted to the host pool) as soon as all its sequences have finished. `stats`: a
        `SamplerStats` that also counts this rollout's decode chunks."""
        prompts_per_piece = len(examples) // pieces
        waiting: dict[int, list[tuple[Completion, Episode | None]]] = {index: [] for index in range(pieces)}
        needed = prompts_per_piece * self.group_size
        if self.episodes is None:
            stream = ((c, None) for c in self.sampler.stream(params, prompt_ids, self.sampling,
                                                             group_size=self.group_size, key=key, version=version,
                                                             stats=stats))
        else:
            stream = ((e.completion, e) for e in self.episodes.run(params, examples, group_size=self.group_size,
                                                                   key=key, version=version, stats=stats))
        for completion, episode in stream:
            index = completion.prompt_index // prompts_per_piece
            waiting[index].append((completion, episode))
            if len(waiting[index]) == needed:
                yield self.pack_piece(index, sorted(waiting.pop(index), key=lambda item: item[0].order), examples)

    def pack_piece(self, index: int, items: list[tuple[Completion, Episode | None]],
                   examples: Sequence[Example]) -> Piece:
        """Piece `index` of finished `items` (completions, each with its episode or None), rows in their order;
        `examples[c.prompt_index]` is each completion's example. Its reward scoring is submitted at once."""
        completions = [c for c, _ in items]
        rows = [examples[c.prompt_index] for c in completions]
        mine = self.own_rows(len(rows))
        texts = [self.decode(c.response_ids) if e is None else e.final_text for c, e in items[mine]]
        batch = pack_rollouts(
            [c.prompt_ids for c in completions], [c.response_ids for c in completions],
            [c.behaviour_logprobs for c in completions], pad_id=self.pad_id, length=self.sequence_length,
            loss_masks=[c.model_mask for c in completions],
            expert_ids=[c.expert_ids for c in completions] if self.sampler.record_routing else None,
        )
        rewards = self.rewards.submit(texts, rows[mine])
        environment = [None if e is None else e.reward for _, e in items[mine]]
        if any(r is not None for r in environment):
            rewards = _with_environment_rewards(rewards, environment)
        return Piece(index=index, examples=rows, completions=completions, batch=batch, rewards=rewards)

    def own_rows(self, rows: int) -> slice:
        """This process's block of a piece's `rows` rows, which it scores: split over every process, or over
        the generation processes alone in a disaggregated run over process groups (`reward_processes`)."""
        if self.reward_processes is None:
            return distributed.process_rows(rows)
        return distributed.process_rows(rows, self.reward_processes.index(jax.process_index()),
                                        len(self.reward_processes))

    def collect_rewards(self, piece: Piece) -> tuple[np.ndarray, RewardStats]:
        """Rewards float32 [rows] of every row of `piece`, and their stats (errors and timeouts summed over
        processes, seconds the slowest process's, `first_error` this process's). With several processes this
        is a collective: every process that scores (`reward_processes`) calls it for the same pieces in the same
        order."""
        local, stats = piece.rewards.result()
        count = jax.process_count() if self.reward_processes is None else len(self.reward_processes)
        if count == 1:
            return local, stats
        rows = len(piece.examples)
        width = -(-rows // count)
        padded = np.zeros(width, np.float32)
        padded[: len(local)] = local
        # every process's reward has the same terms (the same function): their sums travel as numbers too
        numbers = np.array([stats.errors, stats.timeouts, stats.seconds, stats.nonfinite,
                            *(x for t in stats.terms for x in (t.total, t.scored, t.errors))], np.float32)
        if self.reward_processes is None:
            gathered = distributed.gather_to_all({"rewards": padded, "numbers": numbers}, tiled=False)
        else:  # the generation group alone: a program over its mesh (no collective spans the two groups)
            stacked = distributed.gather_over_mesh(np.concatenate([padded, numbers]), self.sampler.mesh)
            gathered = {"rewards": stacked[:, :width], "numbers": stacked[:, width:]}
        blocks = [distributed.process_rows(rows, process, count) for process in range(count)]
        rewards = np.concatenate([gathered["rewards"][p][: b.stop - b.start] for p, b in enumerate(blocks)])
        numbers = np.asarray(gathered["numbers"]).sum(0)  # [4 + 3 x terms] summed over processes
        seconds = np.asarray(gathered["numbers"])[:, 2].max()
        terms = tuple(TermStats(name=t.name, total=float(numbers[4 + 3 * i]), scored=int(numbers[5 + 3 * i]),
                                errors=int(numbers[6 + 3 * i])) for i, t in enumerate(stats.terms))
        return rewards, RewardStats(count=rows, errors=int(numbers[0]), timeouts=int(numbers[1]),
                                    nonfinite=int(numbers[3]), mean_reward=float(rewards.mean()), seconds=float(seconds),
                                    first_error=stats.first_error, terms=terms)


def _with_environment_rewards(task: concurrent.futures.Future, environment: list[float | None]
                              ) -> concurrent.futures.Future:
    """A future of the task's `(rewards, stats)` in which the rows an environment rewarded hold its reward."""
    combined: concurrent.futures.Future = concurrent.futures.Future()

    def done(future: concurrent.futures.Future) -> None:
        try:
            rewards, stats = future.result()
        except BaseException as error:
            combined.set_exception(error)
            return
        rewards = np.array(rewards, np.float32)
        for row, value in enumerate(environment):
            if value is not None:
                rewards[row] = value
        combined.set_result((rewards, dataclasses.replace(stats, mean_reward=float(rewards.mean()))))

    task.add_done_callback(done)
    return combined


def concatenate_pieces(pieces: Sequence[Piece]) -> TrainBatch:
    """The step's whole batch, rows in prompt order."""
    fields = {}
    for field in dataclasses.fields(TrainBatch):
        values = [getattr(piece.batch, field.name) for piece in pieces]
        if values[0] is None:
            continue
        fields[field.name] = np.concatenate([np.asarray(v) for v in values]) if len(values) > 1 else values[0]
    return TrainBatch(**fields)
