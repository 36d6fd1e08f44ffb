"""Joining or starting Ray, and sizing the worker pool. Ray is imported here, and only when asked for."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def user_errors() -> Iterator[None]:
    """Re-raise a :class:`UserError` raised inside a Ray task as itself, without Ray's wrapping and notes,
    so that the message (file, column, example row) reads as it does with the local engine."""
    try:
        yield
    except Exception as err:  # Ray's wrapper of a UserError is a UserError too: look inside every error
        found = _user_error(err)
        if found is None or found is err:
            raise
        # Ray Data appends retry advice to the message; a UserError's message is one line
        raise type(found)(str(found).splitlines()[0]) from None


def _user_error(err: BaseException) -> UserError | None:
    """The first :class:`UserError` in the chain of causes of ``err`` that is not Ray's wrapper of one."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        wrapped = getattr(current, "cause", None)  # a RayTaskError: the exception the task raised
        if isinstance(current, UserError) and not isinstance(wrapped, BaseException):
            return current
        todo += [wrapped if isinstance(wrapped, BaseException) else None, current.__cause__, current.__context__]
    return None
