"""LoRA adapters as a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`), which
`peft.PeftModel.from_pretrained(base, path)` applies to the Hugging Face base model.

PEFT's `nn.Linear` adapters compute y = x W^T + (alpha / r) * x lora_A^T lora_B^T, with lora_A [r, in] and
lora_B [out, r]. Ours (`rpegjax.models.lora`) are A [in..., r] and B [r, out...] in our kernel layout, whose
flattened in/out dims are Hugging Face's (head-major, as `rpegjax.models.hf_layout`), so

    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight = A.reshape(-1, r).T      [r, in]
    base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight = B.reshape(r, -1).T      [out, r]

(`mlp.{gate,up,down}_proj` likewise). A value head is not part of the adapter format and is not written.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from rpegjax.distributed.collectives import barrier, lowest_process, spanning_mesh
from rpegjax.models.hf import _host_fetcher, _replace_directory, _write_json
from rpegjax.models.lora import LoRAConfig, LoRAParam, LoRATarget, adapter_name
from rpegjax.models.safetensors_file import write_safetensors
from rpegjax.models.transformer import Decoder

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"

# our module (within a layer) and Hugging Face's, for each target
_MODULES = {
    LoRATarget.Q: ("attention", "self_attn"), LoRATarget.K: ("attention", "self_attn"),
    LoRATarget.V: ("attention", "self_attn"), LoRATarget.O: ("attention", "self_attn"),
    LoRATarget.GATE: ("mlp", "mlp"), LoRATarget.UP: ("mlp", "mlp"), LoRATarget.DOWN: ("mlp", "mlp"),
}


def peft_config(lora: LoRAConfig, *, base_model: str | None) -> dict:
    """The adapter_config.json of `lora` (PEFT's LoraConfig fields)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(f"{t.value}_proj" for t in lora.targets), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": base_model, "revision": None,
    }


def peft_tensor_names(model: Decoder) -> list[tuple[str, tuple, str, tuple[int, ...]]]:
    """(PEFT name, our adapter path, 'a' or 'b', PEFT shape) of every adapter matrix of `model`, in file order."""
    if model.lora is None:
        raise ValueError("peft_tensor_names: the model carries no LoRA adapters")
    rank, names = model.lora.rank, []
    for layer in range(model.cfg.num_layers):
        for target in model.lora.targets:
            ours, theirs = _MODULES[target]
            path = ("layers", layer, ours, adapter_name(target))
            adapter = getattr(getattr(model.layers[layer], ours), adapter_name(target))
            fan_in = int(np.prod(adapter.a.get_value().shape[:-1]))
            fan_out = int(np.prod(adapter.b.get_value().shape[1:]))
            prefix = f"base_model.model.model.layers.{layer}.{theirs}.{target.value}_proj"
            names.append((f"{prefix}.lora_A.weight", path, "a", (rank, fan_in)))
            names.append((f"{prefix}.lora_B.weight", path, "b", (fan_out, rank)))
    return names


def save_peft_adapter(model: Decoder, path: str | Path, *, base_model: str | None = None) -> Path:
    """Writes `model`'s adapters as a PEFT adapter directory at `path` (replacing one there, through a temporary
    sibling), in the adapters' dtype. `base_model`: recorded as `base_model_name_or_path`. Adapters sharded over
    several processes: every process calls this, process 0 writes."""
    target = Path(path)
    flat = dict(nnx.to_flat_state(nnx.state(model, LoRAParam)))
    names = peft_tensor_names(model)
    to_host = _host_fetcher()
    dtype = np.dtype(flat[(*names[0][1], "a")].get_value().dtype)

    def tensors():
        for name, adapter, which, _ in names:
            value = to_host(flat[(*adapter, which)].get_value())
            matrix = value.reshape(-1, value.shape[-1]) if which == "a" else value.reshape(value.shape[0], -1)
            yield name, np.ascontiguousarray(matrix.T).astype(dtype)

    mesh = spanning_mesh(nnx.state(model, LoRAParam))  # the processes holding the adapters, the first writing
    collective = mesh is not None
    if collective and jax.process_index() != lowest_process(mesh):
        for _ in tensors():
            pass
        barrier(f"save_peft_adapter {target}", mesh)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.tmp")
    staging.mkdir(exist_ok=True)
    try:
        _write_json(staging / ADAPTER_CONFIG_FILE, peft_config(model.lora, base_model=base_model))
        write_safetensors(staging / ADAPTER_WEIGHTS_FILE, [(name, dtype, shape) for name, _, _, shape in names],
                          tensors(), metadata={"format": "pt"})
        _replace_directory(staging, target)
    finally:
        if staging.exists():
            for file in staging.iterdir():
                file.unlink()
            staging.rmdir()
    if collective:
        barrier(f"save_peft_adapter {target}", mesh)
    return target
