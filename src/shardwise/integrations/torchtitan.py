"""torchtitan's checkpoint manager on shardwise (``docs/torchtitan.md``).

A torchtitan 0.3.0 trainer picks its checkpoint manager by configuration, so switching is one
line of the job's config::

    checkpoint=ShardwiseCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

The manager keeps torchtitan's meaning of every shared field (``BaseCheckpointManager.Config``)
and writes a series of shardwise checkpoints through :class:`CheckpointManager`: every byte
verified on load, no pickle, resume falling back past a corrupt checkpoint, retention beyond
the newest ``k``, preemption, incremental saves, and with ``local_interval`` a node-local,
peer-replicated tier that a restart restores from.

Importing this module imports torchtitan (an optional dependency: ``shardwise[torchtitan]``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer.base import (  # type: ignore[import-untyped,import-not-found]
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP  # type: ignore[import-untyped,import-not-found]
from torchtitan.tools import filesystem  # type: ignore[import-untyped,import-not-found]

from shardwise.checkpoint import (
    CheckpointManager,
    LocalTier,
    RetentionPolicy,
    SavePolicy,
    load,
    load_safetensors,
    save_safetensors,
)

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup

__all__ = ["ShardwiseCheckpointManager"]

logger = logging.getLogger("shardwise.integrations.torchtitan")

#: Appended to a step's directory name for the Hugging Face export of ``last_save_in_hf``: a
#: name the series ignores (only ``step-NNNNNNNN`` exactly is a checkpoint of the series), so
#: its retention never deletes the export.
HF_SUFFIX = "-hf"


def _never(step: int) -> bool:
    """The save policy of the underlying manager: this backend decides when a save is due."""
    return False


def _signal_of(name: str) -> signal.Signals:
    """The signal named ``name`` (``"SIGTERM"``, ``"SIGUSR1"``); ValueError when none is."""
    try:
        return signal.Signals[name]
    except KeyError:
        known = ", ".join(sorted(s.name for s in signal.Signals if not s.name.startswith("SIG_")))
        raise ValueError(
            f"preemption_signals: {name!r} is not a signal name of this platform ({known})"
        ) from None


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


#: The local tier's fields of the config and their defaults (each is ``LocalTier``'s field of
#: the name without ``local_``), set only with ``local_interval``.
_LOCAL_DEFAULTS = {
    "local_replicas": 1,
    "local_keep": 2,
    "local_directory": None,
    "local_job_id": None,
}


def _local_tier(config: ShardwiseCheckpointManager.Config) -> LocalTier | None:
    """The local tier of ``config`` (None when ``local_interval`` is 0), made where the job
    runs: its id defaults to torchrun's ``--rdzv-id``, read from the environment.

    Raises:
        TypeError, ValueError: A ``local_*`` setting is invalid (the message names
            ``LocalTier``'s field, which is the setting's name without ``local_``).
    """
    if not config.local_interval:
        return None
    try:
        return LocalTier(
            every_steps=config.local_interval,
            replicas=config.local_replicas,
            keep=config.local_keep,
            job_id=config.local_job_id,
            directory=config.local_directory,
        )
    except (TypeError, ValueError) as err:
        raise type(err)(f"checkpoint local tier (local_* settings): {err}") from err


class ShardwiseCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan's ``BaseCheckpointManager`` writing a series of shardwise checkpoints.

    Built by the trainer from ``Trainer.Config.checkpoint`` (``config.checkpoint.build(...)``)
    with torchtitan's arguments. Every method is collective: the trainer calls them on every
    rank, in the same order.

    The state saved is torchtitan's: the model's state dict flattened to the top level (its
    FQNs), then ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state`` and any other
    entry of ``states``. Checkpoints are ``<dump_folder>/<folder>/step-00000100`` (shardwise's
    step names; torchtitan's DCP manager writes ``step-100``).

    Args:
        config: The settings (:class:`ShardwiseCheckpointManager.Config`).
        dataloader: Saved as ``dataloader`` (None: not saved).
        model_parts: The model (its parts, with pipeline parallelism).
        optimizers: torchtitan's ``OptimizersContainer``.
        lr_schedulers: torchtitan's ``LRSchedulersContainer``.
        states: Further entries to save (the trainer passes ``{"train_state": trainer}``);
            updated in place with the four above, as torchtitan's manager does.
        sd_adapter: The model's ``StateDictAdapter`` (needed for Hugging Face loads and saves).
        base_folder: The job's dump folder; ``config.folder`` is joined below it as torchtitan
            joins it (an absolute folder or a URL stands alone).

    Raises:
        ValueError: A setting is invalid (the message names it).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint settings, and shardwise's own below them."""

        async_save: bool = True
        """Save in the background: ``save`` returns at once, the state is copied to shared
        host memory on a thread while the next step's forward and backward run
        (``maybe_wait_for_staging`` waits for the copy), and a writer process writes it.
        False: each save has committed when ``save`` returns."""

        incremental: bool = False
        """Each save writes only the chunks whose bytes changed since the checkpoint before
        it, and references the others (a LoRA fine-tune writes its adapters)."""

        verify: bool = True
        """Verify every byte read on load against its checksum (False trusts the storage)."""

        keep_every: int | None = None
        """Also keep, for ever, every checkpoint whose step is a multiple of this."""

        keep_best: int | None = None
        """Also keep the ``keep_best`` best checkpoints by ``best_metric`` (reported with
        ``report_metrics``)."""

        best_metric: str | None = None
        """The metric ``keep_best`` ranks by (e.g. ``"loss"``)."""

        best_mode: Literal["min", "max"] = "min"
        """Whether the best ``best_metric`` is the lowest or the highest."""

        preemption_signals: list[str] = field(default_factory=list)
        """Signal names (``["SIGTERM", "SIGUSR1"]``) that make the next ``save`` call save on
        every rank, whatever the interval; then ``preempted`` is True."""

        storage_options: dict[str, Any] | None = None
        """fsspec options for a ``folder`` or ``initial_load_path`` that is a URL."""

        local_interval: int = 0
        """shardwise's local tier (``docs/manager.md``, *Local tier*): 0 is off; N keeps a
        copy of every N-th step in node-local memory, each rank's part also held by
        ``local_replicas`` ranks of other nodes, and ``load`` restores the newest such step
        when it is newer than the folder's newest checkpoint, from memory and the peers
        instead of the folder. Independent of ``interval``."""

        local_replicas: int = 1
        """Ranks on other nodes holding a copy of each rank's local part (``LocalTier.replicas``:
        0 survives a restart of the processes, not the loss of a node)."""

        local_keep: int = 2
        """The newest local steps kept on each node, 1 or 2 (``LocalTier.keep``)."""

        local_directory: str | None = None
        """The node-local directory (``LocalTier.directory``); None: ``/dev/shm/shardwise-<job
        id>``."""

        local_job_id: str | None = None
        """The job's id (``LocalTier.job_id``): None takes torchrun's ``--rdzv-id``; pass the
        scheduler's job id to keep the local steps across a requeue on the same nodes."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.initial_load_in_hf_quantized:
                raise ValueError(
                    "initial_load_in_hf_quantized is not supported by "
                    "ShardwiseCheckpointManager: dequantize the weights, or use torchtitan's "
                    "CheckpointManager.Config for this load"
                )
            _check_count("keep_every", self.keep_every)
            _check_count("keep_best", self.keep_best)
            if self.keep_best is not None and not self.best_metric:
                raise ValueError("keep_best requires best_metric (the metric to rank by)")
            if self.best_metric is not None and self.keep_best is None:
                raise ValueError("best_metric has no effect without keep_best")
            if self.best_mode not in ("min", "max"):
                raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
            if isinstance(self.preemption_signals, str):
                raise ValueError(
                    "preemption_signals must be a list of signal names, e.g. ['SIGTERM'], "
                    f"got the string {self.preemption_signals!r}"
                )
            for name in self.preemption_signals:
                _signal_of(name)
            if self.storage_options is not None and not isinstance(self.storage_options, dict):
                raise ValueError(
                    f"storage_options must be a dict or None, got {type(self.storage_options)}"
                )
            interval = self.local_interval
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
                raise ValueError(
                    f"local_interval must be an int >= 0 (0: no local tier), got {interval!r}"
                )
            if not interval:
                for name, default in _LOCAL_DEFAULTS.items():
                    if getattr(self, name) != default:
                        raise ValueError(f"{name} has no effect without local_interval")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: concurrent.futures.Future[Any] | None = None
        if not self.enable:
            return
        self.folder: str = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.initial_load_in_hf = config.initial_load_in_hf
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        self.export_dtype: torch.dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        if self.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        self.verify = config.verify
        self.storage_options = config.storage_options
        self._async = config.async_save
        self._preemptible = bool(config.preemption_signals) and not self.load_only
        # The background staging thread runs the manager's collectives while the training
        # thread runs its own: on a group of their own, so that the two never interleave on
        # one group in different orders on different ranks.
        self._group: ProcessGroup | None = None
        if self._async and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        self._local = None if self.load_only else _local_tier(config)
        self._manager = CheckpointManager(
            self.folder,
            save_policy=SavePolicy(should_save=_never),
            retention=RetentionPolicy(
                keep_last=config.keep_latest_k or None,
                keep_every=config.keep_every,
                keep_best=config.keep_best,
                best_metric=config.best_metric,
                best_mode=config.best_mode,
            ),
            async_save=self._async,
            preemption_signals=[_signal_of(name) for name in config.preemption_signals],
            process_group=self._group,
            storage_options=self.storage_options,
            incremental=config.incremental,
            local_tier=self._local,
        )
        self._stager: concurrent.futures.ThreadPoolExecutor | None = None
        self._staging: concurrent.futures.Future[bool] | None = None
        self._metrics: dict[str, float] = {}
        logger.info("shardwise checkpointing active: checkpoints under %s", self.folder)

    # -- what torchtitan's trainer and scripts see -----------------------------------------

    @property
    def preempted(self) -> bool:
        """True once a preemption signal made a save happen: stop training and exit."""
        return bool(self.enable and self._manager.preempted)

    def report_metrics(self, metrics: Mapping[str, float]) -> None:
        """Numbers recorded with the next checkpoints (``keep_best`` ranks by ``best_metric``).

        torchtitan's trainer passes no metrics to ``save``: call this (e.g. from a Trainer
        subclass, after validation) on every rank; rank 0's are recorded.
        """
        self._metrics = dict(metrics)

    def path(self, step: int) -> str:
        """The directory (or URL) of step ``step``'s checkpoint."""
        return self._manager.path(step)

    # -- saving ------------------------------------------------------------------------------

    def _due(self, step: int, last_step: bool) -> bool:
        """torchtitan's rule (the same on every rank: it depends on the step alone)."""
        if self.load_only:
            return False
        if step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or step % self.interval == 0

    def _flattened(self, states: Mapping[str, Any]) -> dict[str, Any]:
        """torchtitan's layout: the model's keys at the top level, the other states beside."""
        flat = {key: value for key, value in states.items() if key != MODEL and value is not None}
        if MODEL in states:
            flat.update(states[MODEL].state_dict())
        return flat

    def _snapshot(self) -> dict[str, Any]:
        """The state to save, as plain state dicts taken now, in the training thread: module
        hooks (FSDP's among them) must not run while forward swaps in unsharded parameters."""
        flat = self._flattened(self.states)
        for key, value in flat.items():
            if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
                flat[key] = value.state_dict()
        return flat

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        due = self._due(curr_step, last_step)
        # The local tier's steps go through the manager too: it saves them by its own rule.
        local = self._local is not None and self._local.wants(curr_step)
        if not due and not local and not self._preemptible:
            return False
        self._finish_staging()
        if due and last_step:
            self._save_last_step(curr_step)
            return True
        state = self._snapshot()
        metrics = dict(self._metrics)
        if not self._async:
            return bool(self._manager.save(curr_step, state, metrics=metrics, force=due))
        if self._stager is None:
            self._stager = concurrent.futures.ThreadPoolExecutor(1, "shardwise-staging")
        self._staging = self._stager.submit(
            self._manager.save, curr_step, state, metrics=metrics, force=due
        )
        self.save_future = self._staging
        return due

    def _save_last_step(self, step: int) -> None:
        """The final checkpoint, synchronously: model only in ``export_dtype`` (and as
        Hugging Face safetensors with ``last_save_in_hf``), else the whole state."""
        if self.last_save_model_only:
            state: dict[str, Any] = {
                key: value.to(self.export_dtype)
                if isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and value.dtype != self.export_dtype
                else value
                for key, value in self.states[MODEL].state_dict().items()
            }
            logger.info("saving a model-only checkpoint in %s at step %d", self.export_dtype, step)
        else:
            state = self._snapshot()
            logger.info("saving a full checkpoint at the last step, step %d", step)
        if self.last_save_in_hf:
            self._manager.wait()
            save_safetensors(
                self.sd_adapter.to_hf(state),
                self.path(step) + HF_SUFFIX,
                process_group=self._group,
                storage_options=self.storage_options,
            )
            return
        self._manager.save(step, state, metrics=dict(self._metrics), force=True)
        self._manager.wait()

    def _finish_staging(self) -> None:
        """Wait for the background save call (staging, then the writer started); raise its
        failure (every rank gets it: the manager raises on every rank)."""
        future, self._staging = self._staging, None
        if future is not None:
            future.result()

    def _maybe_wait_for_staging(self) -> None:
        self._finish_staging()

    def _wait_for_saving(self) -> None:
        self._finish_staging()
        self._manager.wait()
        self.save_future = None

    # -- loading -----------------------------------------------------------------------------

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return dict(self.states[MODEL].state_dict())
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        kept = {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}
        return self._flattened(kept)

    def _loaded(self, state: dict[str, Any]) -> None:
        """Push the model's loaded values into the modules: tensors made by state-dict hooks
        (a fused projection split in three) were filled, not the parameters behind them."""
        self.states[MODEL].load_state_dict(state)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        self._finish_staging()
        verify = self.verify
        if step != -1:
            model_only = step == 0
            state = self._states_to_load(model_only)
            self._manager.restore(step, state, allow_dtype_cast=model_only, verify=verify)
            self._loaded(state)
            logger.info("restored %s", self.path(step))
            return True
        steps = self._manager.steps()
        # torchtitan's fault-tolerance branch: a series to resume (or a local step newer than
        # the folder's newest checkpoint) ignores initial_*.
        restored: int | None = None
        if steps and steps[-1] == 0:  # a seed checkpoint: the model alone
            if self._local is not None:  # unless the local tier holds a step trained from it
                state = self._states_to_load(False)
                restored = self._manager.restore_local(state, verify=verify)
            if restored is None:
                state = self._states_to_load(True)
                restored = self._manager.restore(0, state, allow_dtype_cast=True, verify=verify)
        elif steps or self._local is not None:
            state = self._states_to_load(False)
            restored = self._manager.restore(None, state, verify=verify)
        if restored is None:
            return self._initial_load()
        self._loaded(state)
        if self._manager.restored_from == "local":
            logger.info("restored step %d from the local tier", restored)
        else:
            logger.info("restored %s", self.path(restored))
        return True

    def _initial_load(self) -> bool:
        path = self.initial_load_path
        if path is None and self.initial_load_in_hf:
            path = getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                raise ValueError(
                    "checkpoint.initial_load_in_hf is True without initial_load_path: it "
                    "needs the model's hf_assets_path (sd_adapter), and there is none"
                )
        if path is None:
            logger.info("no checkpoint to load: a fresh start")
            return False
        if not filesystem.is_remote(path) and not os.path.isdir(path):
            raise ValueError(f"Checkpoint.initial_load_path is invalid: {path}")
        if self.initial_load_in_hf:
            if self.sd_adapter is None:
                raise ValueError(
                    "checkpoint.initial_load_in_hf is True, but sd_adapter is not provided."
                )
            hf_state = self.sd_adapter.to_hf(self.states[MODEL].state_dict())
            load_safetensors(
                hf_state,
                path,
                process_group=self._group,
                allow_dtype_cast=True,
                storage_options=self.storage_options,
            )
            self._loaded(self.sd_adapter.from_hf(hf_state))
        else:
            model_only = self.initial_load_model_only
            state = self._states_to_load(model_only)
            load(
                state,
                path,
                process_group=self._group,
                verify=self.verify,
                allow_dtype_cast=model_only,
                storage_options=self.storage_options,
                strict=True,
            )
            self._loaded(state)
        logger.info("loaded the initial checkpoint %s", path)
        return True

    # -- lifetime ----------------------------------------------------------------------------

    def _close(self) -> None:
        try:
            self._finish_staging()
        finally:
            try:
                self._manager.close()
            finally:
                if self._stager is not None:
                    self._stager.shutdown()
                self.save_future = None
