"""Verifiable rewards and the built-in tasks.

Modules (imported one by one, so that a reward worker process loads only what its function needs):
`math` (math-verify answer checking), `format` (think/answer format, DAPO over-length penalty),
`runner` (`RewardRunner`: timeouts, thread or process isolation, async submit, broken workers replaced),
`workers` (a worker process or thread: start, feed, kill), `scoring` (the worker side: value checks, rewards
scored term by term, the serve loop), `channel` (the worker's pipe: JSON frames read without blocking),
`expression` (safe arithmetic parser), `task` (the `Task` protocol, held-out split), `arithmetic` and
`countdown` (built-in generated tasks), `tasks` (`TASKS`, `make_task`), `dataset_task` (a loaded dataset as
a math-verify task), `custom` (user reward functions named by `module:function=weight` specs, per-completion
or TRL's batched form, their weighted sum scored term by term, `RewardedTask`).
"""
