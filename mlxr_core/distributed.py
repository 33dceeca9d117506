"""Serving across processes on ``mx.distributed``: which rank this process is, and what it may do.

``mlxr launch`` (:mod:`mlxr_core.cli.launch`) starts ``distributed.tensor_parallel`` x
``distributed.pipeline_parallel`` copies of ``mlxr serve`` through ``mlx.launch``, which tells each
its rank (``MLX_RANK``) and how to reach the others (``MLX_HOSTFILE`` for ring, ``NCCL_*`` ...).
:func:`join_world` joins them into one group. Rank 0 serves HTTP; every rank runs the engine, which
keeps them in lockstep (:mod:`mlxr_core.engine.lockstep`) and splits each model's weights across
them (:mod:`mlxr_core.model.tensor_parallel`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.errors import ConfigError

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config, DistributedConfig

log = logging.getLogger(__name__)

#: Backends whose MLX implementation has point-to-point ``send``/``recv`` (pipeline parallelism).
SEND_RECV_BACKENDS = frozenset({"ring", "mpi", "jaccl"})


@attrs.frozen
class World:
    """This process's place among the ranks serving together."""

    group: Any = attrs.field(repr=False)  # mx.distributed.Group
    rank: int
    size: int
    backend: str
    #: Ranks each layer is split across; ranks ``[0, tensor_parallel)`` form the first stage.
    tensor_parallel: int
    pipeline_parallel: int
    #: Seconds one engine step may take before a peer counts as dead (``distributed.step_timeout_s``).
    step_timeout_s: float

    @property
    def tensor_group(self) -> Any:
        """The group each layer is split across, or None (``tensor_parallel`` 1)."""
        return self.group if self.tensor_parallel > 1 else None

    @property
    def pipeline_group(self) -> Any:
        """The group the layers are split across, or None (``pipeline_parallel`` 1)."""
        return self.group if self.pipeline_parallel > 1 else None

    @property
    def leader(self) -> bool:
        """Rank 0: the one that serves HTTP and decides each engine step."""
        return self.rank == 0


def check_distributed(config: Config) -> None:
    """Refuse, before anything loads, what cannot run across ranks: a prefix cache disk tier (each
    rank would find different entries, so their steps would part), pipeline stages (not yet)."""
    distributed = config.distributed
    if distributed.world_size == 1:
        return
    if config.engine.prefix_cache.disk is not None:
        raise ConfigError(
            "engine.prefix_cache.disk: not available with distributed: (each rank's disk would hold "
            "different entries); set it to null",
            field="engine.prefix_cache.disk",
        )


def join_world(config: DistributedConfig) -> World | None:
    """Join the group ``mlx.launch`` started (None for a one-process config).

    :raises ConfigError: naming ``distributed.*`` when this process was not started by
        ``mlx.launch`` (``mlxr launch``), the backend cannot start here, or the group's size is
        not ``tensor_parallel`` x ``pipeline_parallel``; or when pipeline stages are asked of a
        backend without send/recv (NCCL).
    """
    if config.world_size == 1:
        return None
    import mlx.core as mx

    backend = resolve_backend(config.backend)
    if config.pipeline_parallel > 1 and backend not in SEND_RECV_BACKENDS:
        raise ConfigError(
            f"distributed.pipeline_parallel: {config.pipeline_parallel} needs send/recv between "
            f"ranks, which MLX's {backend} backend does not have (only {', '.join(sorted(SEND_RECV_BACKENDS))}); "
            "use tensor_parallel on it",
            field="distributed.pipeline_parallel",
        )
    if config.pipeline_parallel > 1 and config.tensor_parallel > 1:
        raise ConfigError(
            "distributed.pipeline_parallel: tensor and pipeline parallelism together are not "
            "supported yet; set one of distributed.tensor_parallel and pipeline_parallel to 1",
            field="distributed.pipeline_parallel",
        )
    launched = "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
    if not launched:
        raise ConfigError(
            f"distributed.tensor_parallel: {config.tensor_parallel} x pipeline_parallel "
            f"{config.pipeline_parallel} asks for {config.world_size} ranks, but this process was not "
            "started by mlx.launch; start it with `mlxr launch --config FILE` (or set both sizes to 1)",
            field="distributed.tensor_parallel",
        )
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"distributed.backend: the {backend} backend cannot start here: {exc}", field="distributed.backend"
        ) from None
    if group.size() != config.world_size:
        raise ConfigError(
            f"distributed.tensor_parallel: {config.tensor_parallel} x pipeline_parallel "
            f"{config.pipeline_parallel} asks for {config.world_size} ranks, but mlx.launch started "
            f"{group.size()}; start it with `mlxr launch --config FILE`, which passes -n",
            field="distributed.tensor_parallel",
        )
    world = World(
        group=group,
        rank=group.rank(),
        size=group.size(),
        backend=backend,
        tensor_parallel=config.tensor_parallel,
        pipeline_parallel=config.pipeline_parallel,
        step_timeout_s=config.step_timeout_s,
    )
    log.info(
        "rank %d of %d (%s backend): tensor parallel %d, pipeline parallel %d",
        world.rank, world.size, backend, world.tensor_parallel, world.pipeline_parallel,
    )  # fmt: skip
    return world


def resolve_backend(choice: str) -> str:
    """``distributed.backend`` as ``mlx.launch`` would pick it: ``auto`` is NCCL where MLX has
    CUDA, else ring."""
    if choice != "auto":
        return choice
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() else "ring"
