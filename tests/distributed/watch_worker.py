"""One process of tests/distributed/test_watch.py: joins the launch (JAX_* variables), starts the peer watch, then
`finish` (every process says goodbye and exits 0), `kill` (process --victim SIGKILLs itself after writing the wall
clock to DIR/died_at; the others compute until the watch ends them) or `fail` (process --victim raises)."""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import signal
import sys
import time

import jax
import jax.numpy as jnp

from rpegjax import distributed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["finish", "kill", "fail"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--victim", type=int, default=1)
    args = parser.parse_args()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cfg = distributed.DistributedConfig.from_env(heartbeat_timeout_s=60)  # the watch must beat the heartbeat
    distributed.initialize(cfg)
    watch = distributed.watch_peers(cfg)
    out = pathlib.Path(args.out)
    print(f"process {cfg.process_id}: watching", flush=True)
    distributed.barrier("watching")
    if args.mode == "finish":
        watch.close()
        return 0
    if cfg.process_id == args.victim:
        if args.mode == "kill":
            (out / "died_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            raise ValueError("the victim's own error")
        except ValueError as error:
            watch.close(error)
            print(f"process {cfg.process_id}: error: {error}", file=sys.stderr, flush=True)
            return 2
    x = jnp.ones((64, 64))
    deadline = time.monotonic() + 120  # the watch must end this loop long before
    while time.monotonic() < deadline:
        x = jax.block_until_ready(jnp.tanh(x @ x))
        time.sleep(0.01)
    return 0


if __name__ == "__main__":
    sys.exit(main())
