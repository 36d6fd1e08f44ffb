"""Settings of the Ray engine (``ray.*`` keys of ``etl`` and ``predict``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RayConfig:
    """How to reach Ray and how much of it to use; read only with ``engine=ray``."""

    address: str = ""
    """Cluster to join ('auto' or host:port of a running `ray start --head`); empty: start a local instance."""
    num_cpus: int = 0
    """CPUs of the local instance started when address is empty; 0: all of this machine's."""
    workers: int = 0
    """Parallel tasks or scoring actors; 0: one per GPU when there are GPUs, else one per cpus_per_worker CPUs."""
    cpus_per_worker: int = 1
    """CPUs reserved by each task or actor (torch threads of a CPU scoring actor)."""

    def __post_init__(self) -> None:
        if self.workers < 0 or self.num_cpus < 0:
            raise ValueError("workers and num_cpus must be >= 0 (0: automatic)")
        if self.cpus_per_worker < 1:
            raise ValueError("cpus_per_worker must be >= 1")
