"""The calculator tool and the tagged-tool environment protocol."""

import pytest

from rpegjax.data.example import Example
from rpegjax.envs.calculator import calculate, calculator_environment


@pytest.mark.parametrize(("expression", "output"), [
    ("2*(3+4)", "14"), (" 7 / 2 ", "7/2"), ("10-4/2", "8"), ("1/0", "error: division by zero"),
    ("2**10", "error: expected a number or '(' but found '*'"),
    ("__import__('os')", "error: unexpected character '_' at 0 in \"__import__('os')\""),
])
def test_calculate(expression, output):
    assert calculate(expression) == output


def test_environment_runs_the_call_that_ends_the_turn():
    env = calculator_environment()
    example = Example(id="e", prompt="Q:12+30\n", answer="42", task="arithmetic")
    [message] = env.reset(example)
    assert message["role"] == "user" and message["content"].endswith("Q:12+30\n") and "<tool>" in message["content"]
    turn = {"role": "assistant", "content": "first <tool>1+1</tool> then <tool>12+30</tool>"}
    observation = env.step([message, turn])
    assert observation.text == "<result>42</result>" and not observation.done and observation.reward is None
    assert env.step([message, {"role": "assistant", "content": "A:42"}]).done  # no call: the episode ends
    assert env.step([message, {"role": "assistant", "content": "<tool>1+1</tool> A:2"}]).done  # not at the end
    with pytest.raises(ValueError, match="step needs the model's turn as the last message"):
        env.step([message])
