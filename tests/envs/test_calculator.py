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


@pytest.mark.parametrize("task_name", ["arithmetic", "countdown"])
def test_a_worked_episode_calls_the_calculator_then_answers_and_verifies(task_name):
    """The warm start's episode: the model's call, the calculator's real answer, then an answer line the task's
    verifier accepts; played back through the environment, the call gets exactly that answer."""
    from rpegjax.envs.calculator import worked_calculator_episode
    from rpegjax.envs.catalog import make_environment
    from rpegjax.rewards.tasks import make_task

    env = make_environment("calculator", tags=("[", "]", "{", "}"))
    task = make_task(task_name)
    for example in task.train_examples(20, seed=0):
        (call, model_call), (result, model_result), (answer, model_answer) = worked_calculator_episode(
            env, example, task.reference_solution(example))
        assert (model_call, model_result, model_answer) == (True, False, True)
        assert call.startswith("[") and call.endswith("]") and result.startswith("{") and result.endswith("}")
        [opening] = env.reset(example)
        observation = env.step([opening, {"role": "assistant", "content": call}])
        assert observation.text == result and not observation.done
        assert env.step([opening, {"role": "assistant", "content": answer}]).done
        assert task.is_correct(answer, example)
        if task_name == "arithmetic":  # the question's own sum: the calculator gives the answer
            assert result == "{" + example.answer + "}"
        else:  # the answer expression: the calculator shows it reaches the target
            assert result == "{" + example.prompt.strip().split("->")[1] + "}"
    assert worked_calculator_episode(env, Example(id="x", prompt="p", answer="1", task="math"), "A:1") is None
