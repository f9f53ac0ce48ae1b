"""A word-level tokenizer over a small vocabulary and a scripted tiny model for multi-turn tests.

The model is a real `Decoder` whose weights make it (almost) a bigram model: one-hot embeddings, attention and
MLP outputs scaled down to a small perturbation, and an LM head that gives each token's successor in `SCRIPT`
a logit 4 above the rest. Greedy sampling therefore follows the script whatever the context, while the
behaviour log-probs (about -0.45) still depend on the whole context, through the perturbation."""

import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rpegjax.models import Decoder, ModelConfig

VOCAB = ["<pad>", "<eos>", "<tool>", "</tool>", "<result>", "</result>", "Q", "A", ":", "\n", "+", "-", "*", "/",
         "(", ")", "x", "y", *"0123456789"]
IDS = {token: index for index, token in enumerate(VOCAB)}
EOS = IDS["<eos>"]
# what the model emits after each token: a calculator call after the question, the answer after the result
SCRIPT = {"\n": "<tool>", "<tool>": "2", "2": "+", "+": "3", "3": "</tool>", "</result>": "A", "A": ":", ":": "5",
          "5": "<eos>", "y": "x", "x": "x"}
_PATTERN = re.compile("|".join(re.escape(t) for t in sorted(VOCAB[1:], key=len, reverse=True)))


def encode(text: str) -> list[int]:
    ids, position = [], 0
    for match in _PATTERN.finditer(text):
        if match.start() != position:
            raise ValueError(f"cannot encode {text[position:match.start()]!r}")
        ids.append(IDS[match.group()])
        position = match.end()
    if position != len(text):
        raise ValueError(f"cannot encode {text[position:]!r}")
    return ids


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids if i not in (IDS["<pad>"], EOS))


def render(messages) -> list[int]:
    return encode("".join(m["content"] for m in messages))


def build_scripted_model() -> tuple[ModelConfig, Decoder]:
    cfg = ModelConfig.tiny(vocab_size=len(VOCAB), eos_token_id=EOS, max_position_embeddings=128)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    d = cfg.hidden_size
    model.embed.set_value(jnp.asarray(np.eye(len(VOCAB), d), model.embed.get_value().dtype))
    for layer in model.layers:
        for module, name in ((layer.attention, "o_proj"), (layer.mlp, "down_proj")):
            value = getattr(module, name).get_value()
            getattr(module, name).set_value(jnp.asarray(0.005 * rng.standard_normal(value.shape), value.dtype))
    head = np.zeros((d, len(VOCAB)))
    for token, successor in SCRIPT.items():
        head[IDS[token], IDS[successor]] = 0.5  # after the final norm a one-hot row is sqrt(d) = 8: logit 4
    model.lm_head.set_value(jnp.asarray(head, model.lm_head.get_value().dtype))
    return cfg, model
