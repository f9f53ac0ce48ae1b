"""Train a reasoning policy with GRPO through the RPEG runtime.

With no arguments: a small model learns the built-in arithmetic task on the CPU (a cached supervised
warm start, then GRPO with asynchrony bound 1). `--help` lists the flags; any config field can be set
as `--section.field=value`.
"""

import sys

from rpegjax.graph.ir import Algorithm
from rpegjax.train.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], Algorithm.GRPO))
