"""Multi-turn rollouts with tools: the environment protocol, the episode runner and the built-in tools."""
