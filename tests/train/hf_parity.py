"""A run's final Hugging Face directory against the weights the run ended with: `transformers` logits."""

import numpy as np


def assert_final_hf_logit_parity(run_dir, token_rows, *, step):
    """`run_dir/hf` loaded by `transformers` gives the logits of the run's last checkpoint (step `step`)."""
    import jax.numpy as jnp
    import torch
    import transformers

    from rpegjax.train.export import load_run, policy_model

    parts, params, last = load_run(run_dir)
    assert last == step
    width = max(len(row) for row in token_rows)
    tokens = np.array([list(row) + [0] * (width - len(row)) for row in token_rows])
    mask = np.arange(width)[None, :] < np.array([len(row) for row in token_rows])[:, None]
    positions = np.broadcast_to(np.arange(width), tokens.shape)
    ours = np.asarray(policy_model(parts, params)(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask)))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"), dtype=torch.float32)
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                       position_ids=torch.tensor(positions.copy())).logits.numpy()
    assert theirs[mask].std() > 0.1  # not a comparison of near-constant logits
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)
