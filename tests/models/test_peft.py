"""LoRA export: the PEFT adapter directory loads in transformers + peft onto the saved base model, and the merged
Hugging Face weights load in transformers alone; both give our adapted model's logits."""

import json

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from rpegjax.models.config import Architecture, ModelConfig
from rpegjax.models.hf import save_pretrained
from rpegjax.models.lora import LoRAConfig, LoRAParam, merge_adapters
from rpegjax.models.peft import ADAPTER_CONFIG_FILE, save_peft_adapter
from rpegjax.models.transformer import Decoder

TOKENS = np.random.default_rng(0).integers(0, 128, (2, 9))


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.mark.parametrize("architecture, targets, dropout", [
    (Architecture.QWEN2, ("q", "k", "v", "o", "gate", "up", "down"), 0.0), (Architecture.LLAMA, ("q", "v", "down"), 0.1)])
def test_peft_adapter_and_merged_weights_load_with_logit_parity(tmp_path, architecture, targets, dropout):
    """With LoRA dropout the adapter directory records it (PEFT's lora_dropout); in eval mode PEFT drops nothing,
    as our log-probs do not."""
    lora = LoRAConfig(rank=4, alpha=8.0, targets=targets, dropout=dropout)
    adapted = Decoder(ModelConfig.tiny(architecture), rngs=nnx.Rngs(0)).with_lora(lora, seed=1)
    rng = np.random.default_rng(2)
    for _, variable in nnx.to_flat_state(nnx.state(adapted, LoRAParam)):  # a trained adapter: B != 0
        variable.set_value(0.2 * rng.standard_normal(variable.get_value().shape).astype(np.float32))
    ours = np.asarray(jax.jit(lambda m: m(TOKENS))(adapted))
    base = adapted.without_lora()
    assert np.abs(ours - np.asarray(base(TOKENS))).max() > 1e-2  # the adapters matter

    save_pretrained(base, base.cfg, tmp_path / "base")
    save_peft_adapter(adapted, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    assert (tmp_path / "adapter" / ADAPTER_CONFIG_FILE).is_file()
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text())["lora_dropout"] == dropout
    assert with_adapter.peft_config["default"].lora_dropout == dropout
    np.testing.assert_allclose(_torch_logits(with_adapter), ours, atol=1e-4, rtol=1e-4)

    merged = nnx.merge(nnx.graphdef(base), merge_adapters(nnx.state(adapted), lora.scale))
    save_pretrained(merged, merged.cfg, tmp_path / "merged")
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(hf_merged), ours, atol=1e-4, rtol=1e-4)
