"""What the supervised warm start trains on (`rpegjax.train.warmstart`): targets, their loss masks, packing."""

import numpy as np
import pytest

from rpegjax.envs.catalog import make_environment
from rpegjax.models.tokenizer import builtin_tokenizer
from rpegjax.rewards.tasks import make_task
from rpegjax.train.warmstart import pack_supervised, worked_targets


def test_with_the_calculator_the_warm_start_trains_the_call_and_the_answer_not_the_tools_output():
    tokenizer = builtin_tokenizer()
    task = make_task("arithmetic")
    example = task.make_example(47, "+", 85)
    env = make_environment("calculator", tags=("[", "]", "{", "}"))
    encode_target, phrase = worked_targets(task, env, tokenizer.encode, tokenizer.eos_id)
    ids, trained = encode_target(example)
    assert tokenizer.decode(ids[:-1]) == "[47+85]{132}A:132" and ids[-1] == tokenizer.eos_id
    shown = "".join(c if t else "_" for c, t in zip(tokenizer.decode(ids[:-1]), trained))
    assert shown == "[47+85]_____A:132" and trained[-1] and "call the calculator" in phrase
    prompt = [5, 6, 7]
    tokens, mask, loss_mask = pack_supervised([prompt], [(ids, trained)], length=40, pad_id=tokenizer.pad_id)
    np.testing.assert_array_equal(loss_mask[0, 3: 3 + len(ids)], np.asarray(trained, np.float32))
    assert loss_mask[0, :3].sum() == 0 and loss_mask[0, 3 + len(ids):].sum() == 0 and mask[0].sum() == 3 + len(ids)


def test_without_an_environment_the_warm_start_trains_the_whole_reference_solution():
    tokenizer = builtin_tokenizer()
    task = make_task("arithmetic")
    example = task.make_example(47, "+", 85)
    encode_target, _ = worked_targets(task, None, tokenizer.encode, tokenizer.eos_id)
    ids, trained = encode_target(example)
    assert tokenizer.decode(ids[:-1]) == task.reference_solution(example) and all(trained)
    other = make_environment("calculator").__class__(name="other", tool=str, call_start="<", call_end=">",
                                                     result_start="(", result_end=")")
    plain, phrase = worked_targets(task, other, tokenizer.encode, tokenizer.eos_id)
    assert "without tool calls (the other tool" in phrase and plain(example) == (ids, trained)
    with pytest.raises(ValueError, match="2 target tokens but 1 flags"):
        pack_supervised([[1]], [([4, 1], [True])], length=8, pad_id=0)
