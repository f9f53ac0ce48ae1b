"""Train a reasoning policy with PPO (GAE, a critic that is a separate model or the actor's trunk with a
value head: `--critic=separate|shared`) through the RPEG runtime. Same flags as train_grpo.py."""

import sys

from rpegjax.graph.ir import Algorithm
from rpegjax.train.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], Algorithm.PPO))
