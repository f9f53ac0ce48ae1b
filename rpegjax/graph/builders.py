"""The standard RPEGs: GRPO and PPO steps as in DESIGN.md, colocated on one placement `all` by default.

    generate -> reward -> ref_logprob / old_logprob / critic_value -> advantage -> actor_update / critic_update
             -> weight_sync -> (next step's) generate

Parameters are explicit payloads (see the version convention in `rpegjax.graph.ir`): actor_update reads
`params:actor` it wrote one step earlier (offset 1) and writes the next version; old_logprob and
critic_value read the current weights (offset 1); weight_sync converts them to the generation layout in the
same step (offset 0), and generate reads that with offset `async_bound + 1`. The reference weights and the
prompts are external.

Learner options are plain arguments because only their effect on the graph's shape matters here:
`use_reference` (KL against a frozen reference), `kl_in_reward` (PPO-style KL penalty folded into the
reward before the advantage, else a KL term in the loss), `recompute_old_logprobs` (a proximal-policy forward
pass; without it the sampler's behaviour log-probs serve as old log-probs), `epochs` and `minibatches`
(recorded as actor_update options for the runtime and performance model).
"""

from __future__ import annotations

from collections.abc import Mapping

from rpegjax.graph.ir import (
    HOST_PLACEMENT,
    Algorithm,
    CriticMode,
    Edge,
    Graph,
    GraphError,
    Payload,
    Placement,
    Role,
    Stage,
    StageKind,
)
from rpegjax.graph.transforms import bounded_async, share_actor_critic

ALL_PLACEMENT = "all"


def _check_options(builder: str, *, num_devices: int, epochs: int, minibatches: int) -> None:
    for name, value in (("num_devices", num_devices), ("epochs", epochs), ("minibatches", minibatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GraphError(f"{builder}: {name} must be a positive integer, got {value!r}")


def _build(*, algorithm: Algorithm, use_reference: bool, critic: bool, kl_in_reward: bool, recompute_old_logprobs: bool,
           num_devices: int, parallel: Mapping[str, int] | None, epochs: int, minibatches: int, name: str) -> Graph:
    P = Payload
    old_source = ("old_logprob", P.OLD_LOGPROBS) if recompute_old_logprobs else ("generate", P.BEHAVIOUR_LOGPROBS)
    stages: list[Stage] = []
    edges: list[Edge] = []

    def add(stage_name: str, kind: StageKind, role: Role, reads: list[tuple[str, str, int]], outputs: list[str],
            *, host: bool = False, external: tuple[str, ...] = (), options: Mapping | None = None) -> None:
        """`reads` lists (producer, payload, offset) edges into the new stage."""
        inputs = [payload for _, payload, _ in reads] + list(external)
        stages.append(Stage(name=stage_name, kind=kind, role=role, placement=HOST_PLACEMENT if host else ALL_PLACEMENT,
                            inputs=tuple(inputs), outputs=tuple(outputs), host=host, options=options or {}))
        edges.extend(Edge(src=src, dst=stage_name, payload=payload, version_offset=offset) for src, payload, offset in reads)

    add("generate", StageKind.GENERATE, Role.ACTOR, [("weight_sync", P.ACTOR_GENERATE_PARAMS, 1)],
        [P.RESPONSES, P.BEHAVIOUR_LOGPROBS], external=(P.PROMPTS,))
    add("reward", StageKind.REWARD, Role.NONE, [("generate", P.RESPONSES, 0)], [P.REWARDS], host=True)
    if use_reference:
        add("ref_logprob", StageKind.REF_LOGPROB, Role.REFERENCE, [("generate", P.RESPONSES, 0)], [P.REF_LOGPROBS],
            external=(P.REFERENCE_PARAMS,))
    if recompute_old_logprobs:
        add("old_logprob", StageKind.OLD_LOGPROB, Role.ACTOR,
            [("generate", P.RESPONSES, 0), ("actor_update", P.ACTOR_PARAMS, 1)], [P.OLD_LOGPROBS])
    if critic:
        add("critic_value", StageKind.CRITIC_VALUE, Role.CRITIC,
            [("generate", P.RESPONSES, 0), ("critic_update", P.CRITIC_PARAMS, 1)], [P.VALUES])
    advantage_reads = [("reward", P.REWARDS, 0)]
    if critic:
        advantage_reads += [("generate", P.RESPONSES, 0), ("critic_value", P.VALUES, 0)]
    if use_reference and kl_in_reward:
        advantage_reads += [("ref_logprob", P.REF_LOGPROBS, 0), (*old_source, 0)]
    add("advantage", StageKind.ADVANTAGE, Role.NONE, advantage_reads,
        [P.ADVANTAGES, P.RETURNS] if critic else [P.ADVANTAGES])
    update_reads = [("generate", P.RESPONSES, 0), ("generate", P.BEHAVIOUR_LOGPROBS, 0), ("advantage", P.ADVANTAGES, 0)]
    if recompute_old_logprobs:
        update_reads.append(("old_logprob", P.OLD_LOGPROBS, 0))
    if use_reference and not kl_in_reward:
        update_reads.append(("ref_logprob", P.REF_LOGPROBS, 0))
    update_reads.append(("actor_update", P.ACTOR_PARAMS, 1))
    add("actor_update", StageKind.ACTOR_UPDATE, Role.ACTOR, update_reads, [P.ACTOR_PARAMS],
        options={"epochs": epochs, "minibatches": minibatches})
    if critic:
        add("critic_update", StageKind.CRITIC_UPDATE, Role.CRITIC,
            [("generate", P.RESPONSES, 0), ("advantage", P.RETURNS, 0), ("critic_value", P.VALUES, 0),
             ("critic_update", P.CRITIC_PARAMS, 1)], [P.CRITIC_PARAMS],
            options={"epochs": epochs, "minibatches": minibatches})
    add("weight_sync", StageKind.WEIGHT_SYNC, Role.ACTOR, [("actor_update", P.ACTOR_PARAMS, 0)], [P.ACTOR_GENERATE_PARAMS])

    external = [P.PROMPTS] + ([P.REFERENCE_PARAMS] if use_reference else [])
    placement = Placement(name=ALL_PLACEMENT, parallel=parallel if parallel is not None else {"data": num_devices})
    return Graph(stages=tuple(stages), edges=tuple(edges), placements={ALL_PLACEMENT: placement}, async_bound=0,
                 num_devices=num_devices, external=tuple(external), algorithm=algorithm, name=name).validate()


def grpo_graph(*, use_reference: bool, async_bound: int = 0, num_devices: int = 1,
               parallel: Mapping[str, int] | None = None, kl_in_reward: bool = False,
               recompute_old_logprobs: bool = True, epochs: int = 1, minibatches: int = 1, name: str = "grpo") -> Graph:
    """A GRPO step: no critic; group-normalised advantages from rewards; KL to the reference in the loss
    (or in the reward with `kl_in_reward`). All device stages on placement `all` with `parallel` sizes
    (default {"data": num_devices}); generation reads weights `async_bound` versions old.
    """
    _check_options("grpo_graph", num_devices=num_devices, epochs=epochs, minibatches=minibatches)
    graph = _build(algorithm=Algorithm.GRPO, use_reference=use_reference, critic=False, kl_in_reward=kl_in_reward,
                   recompute_old_logprobs=recompute_old_logprobs, num_devices=num_devices, parallel=parallel,
                   epochs=epochs, minibatches=minibatches, name=name)
    return bounded_async(graph, async_bound)


def ppo_graph(*, use_reference: bool, critic: CriticMode | str = CriticMode.SEPARATE, async_bound: int = 0,
              num_devices: int = 1, parallel: Mapping[str, int] | None = None, kl_in_reward: bool = True,
              recompute_old_logprobs: bool = True, epochs: int = 1, minibatches: int = 1, name: str = "ppo") -> Graph:
    """A PPO step with a critic: GAE advantages and returns from rewards and values; KL to the reference
    folded into the reward by default. `critic="shared"` applies `share_actor_critic` (needs
    `recompute_old_logprobs`, whose stage then also computes the values).
    """
    _check_options("ppo_graph", num_devices=num_devices, epochs=epochs, minibatches=minibatches)
    try:
        mode = CriticMode(critic)
    except ValueError:
        raise GraphError(f"ppo_graph: critic must be one of {[m.value for m in CriticMode]}, got {critic!r}") from None
    if mode is CriticMode.SHARED and not recompute_old_logprobs:
        raise GraphError("ppo_graph: critic='shared' merges values into the old_logprob stage, "
                         "so it needs recompute_old_logprobs=True")
    graph = _build(algorithm=Algorithm.PPO, use_reference=use_reference, critic=True, kl_in_reward=kl_in_reward,
                   recompute_old_logprobs=recompute_old_logprobs, num_devices=num_devices, parallel=parallel,
                   epochs=epochs, minibatches=minibatches, name=name)
    if mode is CriticMode.SHARED:
        graph = share_actor_critic(graph)
    return bounded_async(graph, async_bound)
