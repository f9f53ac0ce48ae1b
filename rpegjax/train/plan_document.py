"""A run's plan file (`graph.plan`): a graph JSON, or a `scripts/plan.py --json` document, which also says for
which model and workload its best plan was made (and what the performance model predicts for it).

A run executes a document's plan only on the plan's own model and workload shapes: the plan's memory and the dry
run's compiled programs (`rpegjax.train.dry_run`) hold for those, so a run whose model or shapes differ is
refused, never run (or dry-run) on a plan made for something else.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from rpegjax.graph.ir import Graph, GraphError
from rpegjax.models.config import ModelConfig

# The ModelConfig fields that size parameters, activations and the KV cache (the document's `model_config`).
SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "tie_word_embeddings", "attention_bias", "qk_norm", "num_experts",
                "num_experts_per_token", "moe_intermediate_size", "moe_capacity_factor")
# a mixture-of-experts model's fields (a plan's costs depend on the capacity mode: `rpegjax.perf.model.expert_costs`),
# as a dense model has them: what a plan document written before they were recorded means
_DENSE_FIELDS = {"num_experts": 0, "num_experts_per_token": 0, "moe_intermediate_size": 0, "moe_capacity_factor": None}


def model_shape(model: ModelConfig) -> dict[str, Any]:
    """`model`'s shape fields as JSON values (what a plan document records of its model)."""
    return {name: (value.value if hasattr(value, "value") else value)
            for name, value in ((name, getattr(model, name)) for name in SHAPE_FIELDS)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanWorkload:
    """The step a plan was made for: prompts x samples, prompt tokens, the longest response."""

    prompts: int
    group_size: int
    prompt_tokens: int
    response_max: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanFile:
    """A plan file read: its graph (the best plan of a document), and for a document its model's name and shape,
    workload and prediction (None for a bare graph JSON)."""

    path: pathlib.Path
    graph: Graph
    model_name: str | None = None
    model_shape: dict[str, Any] | None = None
    workload: PlanWorkload | None = None
    prediction: dict[str, Any] | None = None

    @property
    def where(self) -> str:
        return f"graph.plan {self.path}"

    def check_run(self, model: ModelConfig, workload: PlanWorkload) -> None:
        """Raises ValueError, naming every difference and the flag that changes it, when the run's model or step
        shapes are not the plan's (a bare graph JSON says nothing of either: nothing to check)."""
        if self.model_shape is None or self.workload is None:
            return
        run_shape = model_shape(model)
        differ = [f"model.{name}: plan {self.model_shape.get(name)!r}, run {run_shape[name]!r}"
                  for name in SHAPE_FIELDS if self.model_shape.get(name, _DENSE_FIELDS.get(name)) != run_shape[name]]
        if differ:
            raise ValueError(f"{self.where}: the plan was made for model {self.model_name!r}, this run's model differs "
                             f"({'; '.join(differ)}); run it on that model (--model DIR of its checkpoint), or plan "
                             f"again for this one (scripts/plan.py --model DIR/config.json)")
        flags = {"prompts": "--prompts-per-step", "group_size": "--group-size", "prompt_tokens": "--max-prompt-len",
                 "response_max": "--max-new-tokens"}
        differ = [f"{flags[name]}: plan {getattr(self.workload, name)}, run {getattr(workload, name)}"
                  for name in flags if getattr(self.workload, name) != getattr(workload, name)]
        if differ:
            raise ValueError(f"{self.where}: the plan was made for another step ({'; '.join(differ)}); set the run's "
                             f"to the plan's, or plan again with the run's")


def read_plan_file(path: str | pathlib.Path) -> PlanFile:
    """The plan file at `path`; ValueError naming the file and what is wrong with it."""
    path = pathlib.Path(path)
    where = f"graph.plan {path}"
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"{where}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error})") from None
    document = data if isinstance(data, dict) and "plans" in data else None
    try:
        graph = Graph.from_dict(data if document is None else document["plans"][0]["graph"]).validate()
    except (GraphError, KeyError, IndexError, TypeError) as error:
        raise ValueError(f"{where}: {error}") from None
    if document is None:
        return PlanFile(path=path, graph=graph)
    return PlanFile(path=path, graph=graph, model_name=document.get("model"),
                    model_shape=_field(document, "model_config", Mapping, where),
                    workload=_workload(document, where), prediction=document["plans"][0].get("prediction"))


def _field(document: Mapping, name: str, kind: type, where: str) -> Any:
    value = document.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"{where}: the plan document has no {name!r} (written by scripts/plan.py --json); plan again")
    return dict(value)


def _workload(document: Mapping, where: str) -> PlanWorkload:
    values = _field(document, "workload", Mapping, where)
    try:
        return PlanWorkload(**{field.name: int(values[field.name]) for field in dataclasses.fields(PlanWorkload)})
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: workload: {error!r} (written by scripts/plan.py --json); plan again") from None
