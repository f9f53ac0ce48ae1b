"""How the processes of one run start and join: `DistributedConfig` from flags, the JAX environment
variables or SLURM, and `initialize` (`jax.distributed.initialize`, gloo collectives on CPU).

See `rpegjax.distributed` for the contract every process follows once joined.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from rpegjax.distributed.hosts import PortRange, ProcessAddress, process_address


class CpuCollectives(enum.StrEnum):
    """Cross-process collectives of the CPU backend (`jax_cpu_collectives_implementation`)."""

    GLOO = "gloo"
    MPI = "mpi"


# ---- configuration ----------------------------------------------------------------------------

# JAX's own SLURM detection picks the port from the job id in this range; we do the same so that
# every task of a job agrees on it without communicating.
_SLURM_PORT_BASE = 65535 - 2**12 + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Where the coordinator is, how many processes there are and which one this is.

    `num_processes` None or 1 means a single process: `initialize` does nothing. Otherwise
    `coordinator_address` ("host:port" of process 0) and `process_id` in [0, num_processes) are
    required (`check_complete`, which `from_env` and `initialize` call). `local_device_ids` restricts this process to some of its host's accelerators (one
    process per GPU); None uses all of them. Timeouts are in seconds: how long to wait for every
    process to join, after how long without heartbeats a process counts as dead (the others then
    fail), and how long a finishing process waits for the others at shutdown. `host_address` is the address the
    other hosts reach this process at (default: this host's address towards the coordinator) and `port_range`
    ("FIRST-LAST") the ports its transfer server and the peer watch may listen on (default: any free port).
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 10
    shutdown_timeout_s: int = 300
    cpu_collectives: CpuCollectives = CpuCollectives.GLOO
    host_address: str | None = None
    port_range: str | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.num_processes is not None and (not _is_int(self.num_processes) or self.num_processes < 1):
            raise ValueError(f"{name}.num_processes must be a positive integer or None, got {self.num_processes!r}")
        if self.process_id is not None and (not _is_int(self.process_id) or self.process_id < 0):
            raise ValueError(f"{name}.process_id must be a non-negative integer or None, got {self.process_id!r}")
        for field in ("initialization_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}.{field} must be a positive integer (seconds), got {value!r}")
        try:
            object.__setattr__(self, "cpu_collectives", CpuCollectives(self.cpu_collectives))
        except ValueError:
            raise ValueError(
                f"{name}.cpu_collectives must be one of {[c.value for c in CpuCollectives]}, got {self.cpu_collectives!r}"
            ) from None
        if self.local_device_ids is not None:
            ids = tuple(self.local_device_ids)
            if not ids or any(not _is_int(i) or i < 0 for i in ids):
                raise ValueError(f"{name}.local_device_ids must be non-negative integers or None, got {self.local_device_ids!r}")
            object.__setattr__(self, "local_device_ids", ids)
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ValueError(f"{name}.process_id must be < num_processes={self.num_processes}, got {self.process_id}")
        if self.coordinator_address is not None:
            _check_address(self.coordinator_address, f"{name}.coordinator_address")
        if self.host_address is not None and (not isinstance(self.host_address, str) or not self.host_address
                                              or any(c in self.host_address for c in " /")):
            raise ValueError(f"{name}.host_address must be this host's address or name, got {self.host_address!r}")
        if self.port_range is not None:
            PortRange.parse(self.port_range, f"{name}.port_range")

    def check_complete(self) -> None:
        """Raises ValueError naming what is missing for a multi-process run. Kept out of __post_init__
        so that command-line overrides can set the fields one at a time."""
        name = type(self).__name__
        if not self.is_multi_process:
            return
        if self.process_id is None:
            raise ValueError(f"{name}.process_id is required when num_processes={self.num_processes}")
        if self.coordinator_address is None:
            raise ValueError(
                f"{name}.coordinator_address ('host:port' of process 0) is required when num_processes={self.num_processes}"
            )

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes is not None and self.num_processes > 1

    def address(self) -> ProcessAddress:
        """Where the other processes reach this one (its transfer server, the peer watch): `host_address`, else
        this host's address towards the coordinator (`rpegjax.distributed.hosts`), on ports of `port_range`."""
        return process_address(self.host_address, self.coordinator_address, self.port_range)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, coordinator_port: int | None = None, **explicit: Any
    ) -> DistributedConfig:
        """Explicit values (keyword arguments that are not None) first, else the environment.

        Environment, in order: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`,
        `JAX_LOCAL_DEVICE_IDS` ("0,1"); then torchrun's `MASTER_ADDR`:`MASTER_PORT`, `WORLD_SIZE`, `RANK`,
        `LOCAL_RANK` (with `LOCAL_WORLD_SIZE` > 1); then SLURM: `SLURM_NTASKS` processes, `SLURM_PROCID` this one,
        coordinator = the first host of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`) at
        `coordinator_port` (default: derived from `SLURM_JOB_ID` like JAX's own SLURM detection), and
        `SLURM_LOCALID` as the device id when several tasks share a node (one process per GPU).
        `environ` defaults to `os.environ`. Raises ValueError naming the variable that does not parse.
        """
        env = os.environ if environ is None else environ
        unknown = set(explicit) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"DistributedConfig.from_env got unknown fields {sorted(unknown)}")
        values = {key: value for key, value in explicit.items() if value is not None}
        found = _from_jax_env(env)
        for key, value in _from_torchrun_env(env).items():
            found.setdefault(key, value)
        if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
            for key, value in _from_slurm_env(env, coordinator_port).items():
                found.setdefault(key, value)
        for key, value in found.items():
            values.setdefault(key, value)
        cfg = cls(**values)
        cfg.check_complete()
        return cfg


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_address(address: Any, where: str) -> None:
    host, sep, port = str(address).rpartition(":") if address else ("", "", "")
    if not (isinstance(address, str) and sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{where} must be 'host:port' of process 0, got {address!r}")


def _env_int(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer") from None


def _from_jax_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if env.get("JAX_COORDINATOR_ADDRESS"):
        values["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    if env.get("JAX_NUM_PROCESSES"):
        values["num_processes"] = _env_int(env, "JAX_NUM_PROCESSES")
    if env.get("JAX_PROCESS_ID"):
        values["process_id"] = _env_int(env, "JAX_PROCESS_ID")
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        text = env["JAX_LOCAL_DEVICE_IDS"]
        try:
            values["local_device_ids"] = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"environment variable JAX_LOCAL_DEVICE_IDS={text!r} is not a comma-separated list of integers") from None
    return values


def _from_torchrun_env(env: Mapping[str, str]) -> dict[str, Any]:
    """torchrun's (and many SSH launchers') variables: MASTER_ADDR:MASTER_PORT, WORLD_SIZE, RANK, and LOCAL_RANK as
    the device id when LOCAL_WORLD_SIZE > 1 processes share a node."""
    values: dict[str, Any] = {}
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        values["coordinator_address"] = f"{env['MASTER_ADDR']}:{_env_int(env, 'MASTER_PORT')}"
    if env.get("WORLD_SIZE"):
        values["num_processes"] = _env_int(env, "WORLD_SIZE")
    if env.get("RANK"):
        values["process_id"] = _env_int(env, "RANK")
    if env.get("LOCAL_RANK") and env.get("LOCAL_WORLD_SIZE") and _env_int(env, "LOCAL_WORLD_SIZE") > 1:
        values["local_device_ids"] = (_env_int(env, "LOCAL_RANK"),)  # several processes per node: one GPU each
    return values


def _from_slurm_env(env: Mapping[str, str], coordinator_port: int | None) -> dict[str, Any]:
    values: dict[str, Any] = {"num_processes": _env_int(env, "SLURM_NTASKS"), "process_id": _env_int(env, "SLURM_PROCID")}
    nodelist_var = next((name for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(name)), None)
    if nodelist_var is not None:
        if coordinator_port is None:
            if not env.get("SLURM_JOB_ID"):
                raise ValueError("SLURM environment without SLURM_JOB_ID: pass coordinator_port explicitly")
            coordinator_port = _env_int(env, "SLURM_JOB_ID") % 2**12 + _SLURM_PORT_BASE
        try:
            host = expand_nodelist(env[nodelist_var])[0]
        except ValueError as error:
            raise ValueError(f"environment variable {nodelist_var}: {error}") from None
        values["coordinator_address"] = f"{host}:{coordinator_port}"
    if env.get("SLURM_LOCALID") and _tasks_per_node(env) > 1:
        values["local_device_ids"] = (_env_int(env, "SLURM_LOCALID"),)
    return values


def _tasks_per_node(env: Mapping[str, str]) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE, else the first count of SLURM_TASKS_PER_NODE ("4(x2),3")."""
    text = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    match = re.match(r"\s*(\d+)", text)
    return int(match.group(1)) if match else 1


def expand_nodelist(text: str) -> list[str]:
    """Expands a SLURM host list: "node[01-03,07],gpu5" -> ["node01", "node02", "node03", "node07", "gpu5"].

    Several bracket groups in one name expand as a product ("r[1-2]n[1-2]" -> r1n1, r1n2, r2n1, r2n2);
    zero padding of range bounds is kept. Raises ValueError on unbalanced brackets or bad ranges.
    """
    hosts: list[str] = []
    for item in _split_top_level(text):
        hosts.extend(_expand_host(item, text))
    if not hosts:
        raise ValueError(f"empty host list {text!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in host list {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_host(item: str, text: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    names = []
    for part in match.group(1).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in host list {text!r}")
        if not dash:
            names.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"descending range {part!r} in host list {text!r}")
        width = len(low)
        names.extend(str(number).zfill(width) for number in range(int(low), int(high) + 1))
    return [host for name in names for host in _expand_host(prefix + name + suffix, text)]


# ---- start-up ---------------------------------------------------------------------------------


def initialize(cfg: DistributedConfig) -> bool:
    """Joins this process to the others (`jax.distributed.initialize`); a no-op for one process.

    Call it first, before any JAX computation (JAX refuses afterwards). On CPU, selects the
    cross-process collectives (`cfg.cpu_collectives`, gloo by default); on GPU, XLA uses NCCL.
    Native libraries' output to standard output is sent to standard error first
    (`keep_native_output_off_stdout`). Returns True when a multi-process runtime was started.
    """
    cfg.check_complete()
    if not cfg.is_multi_process:
        return False
    keep_native_output_off_stdout()
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives.value)
    try:
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
            local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids is not None else None,
            # every value is explicit: never let JAX guess from the environment behind our back
            cluster_detection_method="deactivate",
            initialization_timeout=cfg.initialization_timeout_s,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
            shutdown_timeout_seconds=cfg.shutdown_timeout_s,
        )
    except Exception as error:  # JAX raises RuntimeError / XlaRuntimeError; say which process and where
        raise RuntimeError(
            f"jax.distributed.initialize failed for process {cfg.process_id} of {cfg.num_processes} "
            f"(coordinator {cfg.coordinator_address}, timeout {cfg.initialization_timeout_s}s): {error}"
        ) from error
    return True


def keep_native_output_off_stdout() -> None:
    """Points file descriptor 1 at standard error and `sys.stdout` at a copy of the original standard output.

    Native libraries write to descriptor 1 directly (gloo prints "[Gloo] Rank 0 is connected to 1 peer
    ranks" when collectives connect); afterwards that lands on standard error, while Python's `print` still
    reaches standard output, which then carries only what the program prints there (the job: its summary
    line). Child processes inherit descriptor 1, so theirs goes to standard error too. Idempotent.
    """
    if sys.stdout is None or getattr(sys.stdout, "_rpegjax_original_stdout", False):
        return  # no standard output to protect (pythonw), or already done
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    stream = open(original, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)  # noqa: SIM115
    stream._rpegjax_original_stdout = True
    sys.stdout = stream


def is_main_process() -> bool:
    """True in process 0: the one that writes metrics, plots and traces."""
    return jax.process_index() == 0
