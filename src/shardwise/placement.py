"""Placement strings: where a shard lives (``rank:3/cuda:3``, ``worker1/cpu``, ``cpu``)."""

from __future__ import annotations

import torch

__all__ = ["RemoteDevice"]


def _parse_error(remote_device: str) -> ValueError:
    return ValueError(
        f"Could not parse remote_device: {remote_device}. The valid format is "
        "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
    )


def _is_torch_remote_device(value: object) -> bool:
    """Whether ``value`` is ``torch.distributed``'s own placement class (``_remote_device``)."""
    cls = type(value)
    return cls.__name__ == "_remote_device" and cls.__module__ == "torch.distributed.remote_device"


class RemoteDevice:
    """A device, optionally on a named RPC worker or on a process-group rank.

    Accepted forms: ``"rank:<r>/<device>"``, ``"<worker>/<device>"``, ``"<device>"``,
    ``"rank:<r>"`` and ``"<worker>"`` (device ``cpu``), or a ``torch.device``.

    Example:
        >>> RemoteDevice("rank:1/cpu").rank()
        1
    """

    __slots__ = ("_device", "_rank", "_worker_name")

    def __init__(self, remote_device: str | torch.device) -> None:
        self._worker_name: str | None = None
        self._rank: int | None = None
        self._device: torch.device
        if _is_torch_remote_device(remote_device):
            # torch's own ``_remote_device``: same grammar, so go through its string form.
            remote_device = str(remote_device)
        if isinstance(remote_device, torch.device):
            self._device = remote_device
            return
        if not isinstance(remote_device, str):
            raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")

        fields = remote_device.split("/")
        if len(fields) == 2:
            worker_part, device_part = fields
        elif len(fields) == 1:
            try:
                self._device = torch.device(remote_device)
                return
            except RuntimeError:
                # Not a device: a bare worker (or ``rank:N``) placed on the CPU.
                worker_part, device_part = remote_device, "cpu"
        else:
            raise _parse_error(remote_device)

        if not worker_part:
            raise _parse_error(remote_device)
        # torch.device's own RuntimeError is part of the contract: let it through.
        self._device = torch.device(device_part)

        worker_fields = worker_part.split(":")
        if len(worker_fields) == 1:
            self._worker_name = worker_part
        elif (
            len(worker_fields) == 2 and worker_fields[0] == "rank" and worker_fields[1].isdecimal()
        ):
            # isdecimal, not isdigit: "²" is a digit that int() rejects with its own message.
            self._rank = int(worker_fields[1])
        else:
            raise _parse_error(remote_device)

    def worker_name(self) -> str | None:
        """The RPC worker name, or ``None`` for rank and bare-device placements."""
        return self._worker_name

    def rank(self) -> int | None:
        """The global process-group rank, or ``None`` for worker and bare-device placements."""
        return self._rank

    def device(self) -> torch.device:
        """The local device on the worker or rank."""
        return self._device

    def __repr__(self) -> str:
        if self._worker_name is not None:
            return f"{self._worker_name}/{self._device}"
        if self._rank is not None:
            return f"rank:{self._rank}/{self._device}"
        return str(self._device)

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if _is_torch_remote_device(other):
            other = RemoteDevice(str(other))
        if not isinstance(other, RemoteDevice):
            return False
        return (
            self._worker_name == other._worker_name
            and self._device == other._device
            and self._rank == other._rank
        )

    def __hash__(self) -> int:
        return hash((self._worker_name, self._device, self._rank))

    def __getstate__(self) -> tuple[str | None, int | None, str]:
        return (self._worker_name, self._rank, str(self._device))

    def __setstate__(self, state: tuple[str | None, int | None, str]) -> None:
        self._worker_name, self._rank, device = state
        self._device = torch.device(device)
