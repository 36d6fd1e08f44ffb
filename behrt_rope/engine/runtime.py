"""Joining or starting Ray, and sizing the worker pool. Ray is imported here, and only when asked for."""

from __future__ import annotations

import logging
from types import ModuleType

from behrt_rope.engine.config import RayConfig
from behrt_rope.errors import UserError

log = logging.getLogger("behrt_rope.engine")


def import_ray() -> ModuleType:
    """The ``ray`` module, or a one-line error saying how to install it."""
    try:
        import ray
        import ray.data
    except ImportError as err:
        raise UserError("engine=ray needs Ray: pip install 'behrt-rope[ray]'") from err
    return ray


def init_ray(config: RayConfig) -> ModuleType:
    """Connect to ``config.address``, or start a local instance; reuse a connection this process already has."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(
            address=config.address or None,
            num_cpus=(config.num_cpus or None) if not config.address else None,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
    resources = ray.cluster_resources()
    log.info("ray: %s CPUs, %s GPUs", resources.get("CPU", 0), resources.get("GPU", 0))
    return ray


def pool_size(ray: ModuleType, config: RayConfig, use_gpus: bool) -> int:
    """Workers: as configured, else one per GPU (``use_gpus``) or one per ``cpus_per_worker`` CPUs."""
    if config.workers:
        return config.workers
    resources = ray.cluster_resources()
    if use_gpus and resources.get("GPU", 0) >= 1:
        return int(resources["GPU"])
    return max(1, int(resources.get("CPU", 1)) // config.cpus_per_worker)
