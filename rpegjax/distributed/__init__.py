"""Many hosts, one program: `jax.distributed` set-up and the helpers a multi-process controller needs.

Every process (one per host, or one per GPU) runs the same controller program. `initialize` joins
the processes into one JAX runtime (a coordinator on process 0; XLA collectives over NCCL on GPU and
gloo on CPU), after which `jax.devices()` lists every process's devices and one jitted function runs
over a mesh that spans them all (`global_mesh`). Each process feeds only its own rows of a batch
(`process_rows`, `host_local_to_global`) and combines host values where the graph needs them
(`gather_to_all`, `gather_over_mesh` (one process group's), `sum_over_processes`, `holds_in_every_process`,
`broadcast_text`, `barrier`).

The contract: every process takes identical decisions. Multi-controller JAX requires all processes
to launch the same jitted computations in the same order with the same shapes; a process that
diverges deadlocks the others inside a collective or trains on a different batch. So the controller:

* derives every decision from the config, the step number and seeded state only: the plan, the
  data order (iterators seeded from the config, each process skipping to the same position), and
  randomness from `jax.random.fold_in(base_key, step)` (never from process-local entropy);
* never branches on wall-clock time, on `jax.process_index()` (except for host I/O: only the main
  process writes metrics, plots and traces; checkpoints are written collectively by all), or on
  anything read from the local machine (free memory, file listings taken mid-run);
* splits host-side work (rewards, data loading) by rows with `process_rows` and gathers the
  results with `gather_to_all`, so every process ends up with the same values.

`assert_same_across_processes(value, what)` checks the contract where it matters (config, plan,
data position, batch digest): it hashes the value in each process, all-gathers the digests and
raises naming `what` if any process disagrees.

Dying peers: the job's peer watch (`watch`) ends every survivor within about a second of a process being
killed, with one line naming the dead process and its host (exit code `DEAD_PEER_EXIT`). Behind it,
`jax.distributed`'s coordination service tracks heartbeats: when a process stops sending them for
`heartbeat_timeout_s` (a host that vanished), every surviving process is terminated with "the JAX distributed
service detected fatal errors ... another task died" instead of waiting forever in a collective.

Hosts: each process is reached by the others at `DistributedConfig.address()` (`hosts`): the
`host_address` flag, else its host's address towards the coordinator, on ports of `port_range` when set.

Standard output: `initialize` sends native libraries' writes to it (gloo's connection messages) to
standard error, so that standard output carries only what the program prints (the job's summary line).

Modules: `launch` (configuration, start-up), `hosts` (addresses, ports), `watch` (dead peers), `data` (mesh, per-process rows, global arrays), `collectives`
(gathers, sums, agreement, broadcast, barriers, the check: programs over one device per process, so processes may
hold different numbers of devices).
Nothing here holds module-level state besides what `jax.distributed` itself holds.
"""

from rpegjax.distributed.collectives import (
    assert_same_across_processes,
    barrier,
    broadcast_text,
    gather_over_mesh,
    gather_text,
    gather_to_all,
    holds_in_every_process,
    sum_over_processes,
    tree_digest,
)
from rpegjax.distributed.data import global_mesh, host_local_to_global, process_rows
from rpegjax.distributed.hosts import PortRange, ProcessAddress
from rpegjax.distributed.launch import (
    CpuCollectives,
    DistributedConfig,
    expand_nodelist,
    initialize,
    is_main_process,
    keep_native_output_off_stdout,
)
from rpegjax.distributed.watch import DEAD_PEER_EXIT, PeerWatch, watch_peers

__all__ = [
    "DEAD_PEER_EXIT",
    "CpuCollectives",
    "PeerWatch",
    "PortRange",
    "ProcessAddress",
    "DistributedConfig",
    "assert_same_across_processes",
    "barrier",
    "broadcast_text",
    "gather_over_mesh",
    "gather_text",
    "expand_nodelist",
    "gather_to_all",
    "global_mesh",
    "holds_in_every_process",
    "host_local_to_global",
    "initialize",
    "is_main_process",
    "keep_native_output_off_stdout",
    "process_rows",
    "sum_over_processes",
    "tree_digest",
    "watch_peers",
]
