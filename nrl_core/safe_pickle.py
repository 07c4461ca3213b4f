"""Reading pickles that are data, never code: unpickling with an allow-list of globals.

A pickle can import and call anything it names, so loading an untrusted one runs its code.
Most of what nrl reads goes through ``torch.load(weights_only=True)``; this module covers the
pickles that torch itself reads unrestricted. The one that matters today is the ``.metadata``
file of a ``torch.distributed.checkpoint`` (DCP) folder, which torch's ``FileSystemReader``
reads with plain ``pickle.load`` and whose non-tensor values (optimizer hyper-parameters) its
``DefaultLoadPlanner`` reads with ``torch.load(weights_only=False)``. :func:`dcp_load` loads
such a checkpoint with both reads restricted.

Importing this module is cheap: torch is imported only by the DCP functions.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nrl_core.errors import ConfigError

Allowed = Callable[[str, str], bool]
"""Decides whether a pickle may use the global ``module.name`` (a class or a function)."""


class UnsafePickleError(ConfigError):
    """A pickle names a global its reader does not allow, or is not a readable pickle."""


class RestrictedUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` that resolves only the globals ``allowed`` accepts.

    Every global a pickle uses (``GLOBAL``/``STACK_GLOBAL`` opcodes and the copyreg extension
    codes alike) goes through :meth:`find_class`, so refusing there means nothing outside the
    allow-list is ever imported or called. Persistent ids are refused too.

    Args:
        file: a binary file object.
        allowed: the allow-list, as a predicate on ``(module, name)``.
        what: how error messages name the file (its path).
    """

    def __init__(self, file: io.BufferedIOBase, allowed: Allowed, *, what: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        if not self._allowed(module, name):
            raise UnsafePickleError(
                f"{self._what} refers to {module}.{name}, which nrl does not load from a "
                "file (unpickling it could run code); use a file written by nrl / torch, "
                "or re-create it"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(
            f"{self._what} holds a persistent reference, which nrl does not load; use a file "
            "written by nrl / torch, or re-create it"
        )


def restricted_load(path: str | os.PathLike, allowed: Allowed) -> Any:
    """Unpickle the file at ``path`` using only the globals ``allowed`` accepts.

    Raises :class:`UnsafePickleError` (a :class:`~nrl_core.errors.ConfigError`, one line
    naming the file) when the pickle names anything else, or is truncated or corrupt.
    """
    what = str(path)
    try:
        with open(path, "rb") as file:
            return RestrictedUnpickler(file, allowed, what=what).load()
    except UnsafePickleError:
        raise
    except OSError as exc:
        raise UnsafePickleError(f"cannot read {what}: {exc.strerror or exc}") from None
    except Exception as exc:  # truncated, corrupt, or an allowed class rejecting its data
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UnsafePickleError(
            f"{what} is not a readable pickle ({type(exc).__name__}: {first}); the file is "
            "truncated or damaged: use another checkpoint or re-create it"
        ) from None


def torch_load_data(path: str | os.PathLike, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, **kwargs)``: tensors, numbers, strings and
    containers only, so loading a planted file cannot run code.

    Raises :class:`UnsafePickleError` (one line naming the file) where torch refuses a global
    the file names, or the file is truncated or unreadable, instead of torch's multi-line
    ``UnpicklingError`` text.
    """
    import torch

    what = str(path)
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        # torch's message: "Weights only load failed. ... Unsupported global: GLOBAL io.open ..."
        text = " ".join(str(exc).split())
        marker = "Unsupported global: GLOBAL "
        named = text[text.index(marker) + len(marker) :].split()[0] if marker in text else ""
        detail = f"refers to {named}, which" if named else "holds an object that"
        raise UnsafePickleError(
            f"{what} {detail} nrl does not load from a file (unpickling it could run code); "
            "use a checkpoint written by nrl, or re-create it"
        ) from None
    except OSError as exc:
        raise UnsafePickleError(f"cannot read {what}: {exc.strerror or exc}") from None
    except (RuntimeError, EOFError, ValueError) as exc:  # truncated or not a torch file
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UnsafePickleError(
            f"{what} is not a readable torch file ({type(exc).__name__}: {first[:200]}); the "
            "file is truncated or damaged: use another checkpoint or re-create it"
        ) from None


# -- torch.distributed.checkpoint ---------------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

DCP_METADATA_GLOBALS = frozenset(
    {
        # The metadata dataclasses (as of torch 2.14; found by unpickling real checkpoints).
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # an Enum: called with its value
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        # torch pickles a layout as _get_layout("torch.strided"): a lookup in torch's layouts.
        ("torch.serialization", "_get_layout"),
        # StorageMeta.checkpoint_id is the folder the checkpoint was written to.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),  # Python >= 3.13 spelling
        ("pathlib._local", "PurePosixPath"),
    }
)
"""The globals a DCP ``.metadata`` pickle may use, besides the ``torch.<dtype>`` objects."""


@functools.cache
def _torch_dtype_names() -> frozenset[str]:
    import torch

    # vars(), not getattr: torch's module __getattr__ imports submodules on demand.
    return frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


def dcp_metadata_allowed(module: str, name: str) -> bool:
    """The allow-list of DCP metadata: :data:`DCP_METADATA_GLOBALS` and ``torch.<dtype>``."""
    if (module, name) in DCP_METADATA_GLOBALS:
        return True
    return module == "torch" and name in _torch_dtype_names()


def load_dcp_metadata(checkpoint: str | os.PathLike, rank: int | None = None) -> Any:
    """The ``Metadata`` of the DCP folder ``checkpoint`` (``.metadata``, or the rank-local
    ``__<rank>.metadata``), read without running code from it.

    Also refuses storage entries that point outside the folder. Raises
    :class:`UnsafePickleError` naming the file.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    name = ".metadata" if rank is None else f"__{rank}.metadata"
    path = Path(checkpoint) / name
    metadata = restricted_load(path, dcp_metadata_allowed)
    if not isinstance(metadata, Metadata):
        raise UnsafePickleError(
            f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
            "metadata; use a checkpoint folder written by nrl"
        )
    sizes: dict[Path, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = Path(str(getattr(info, "relative_path", "")))
        if relative.is_absolute() or ".." in relative.parts:
            raise UnsafePickleError(
                f"{path} points at {relative}, outside the checkpoint folder; use a checkpoint "
                "folder written by nrl"
            )
        _check_extent(path, relative, info, sizes)
    return metadata


def _check_extent(path: Path, relative: Path, info: Any, sizes: dict[Path, int]) -> None:
    """Refuse a storage entry of the metadata ``path`` whose byte range (``offset``,
    ``length``) is not inside its data file ``relative``: DCP would seek past the end and
    fail with a bare ``EOFError`` (or try to read a terabyte). ``sizes`` caches file sizes."""
    if relative not in sizes:
        try:
            sizes[relative] = (path.parent / relative).stat().st_size
        except OSError:
            raise UnsafePickleError(
                f"{path} names the data file {relative}, which is missing; the checkpoint is "
                "incomplete: use another checkpoint"
            ) from None
    offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
    if (
        not isinstance(offset, int)
        or not isinstance(length, int)
        or offset < 0
        or length < 0
        or offset + length > sizes[relative]
    ):
        raise UnsafePickleError(
            f"{path} says {relative} holds bytes at offset {offset!r} (length {length!r}), "
            f"outside the file's {sizes[relative]} bytes; the metadata is damaged: use another "
            "checkpoint"
        )


@functools.cache
def _dcp_classes() -> tuple[type, type]:
    """A ``FileSystemReader`` and a ``DefaultLoadPlanner`` whose pickle reads are restricted
    (built on first use: defining them imports torch)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """Reads ``.metadata`` with :func:`load_dcp_metadata` instead of ``pickle.load``."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = load_dcp_metadata(self.path, kwargs.get("rank"))
            # What FileSystemReader.read_metadata does after unpickling.
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """Checks each non-tensor value with ``torch.load(weights_only=True)`` before the
        default planner loads it (which it does with ``weights_only=False``)."""

        checkpoint = ""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            start = value.tell()
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                first = (str(exc).strip().splitlines() or [""])[0]
                raise UnsafePickleError(
                    f"{self.checkpoint}: the saved value of {read_item.dest_index.fqn} is not "
                    f"plain data ({first}); nrl does not load it (it could run code): use a "
                    "checkpoint folder written by nrl"
                ) from None
            # The bytes only use what weights_only allows, so the default load is safe.
            value.seek(start)
            super().load_bytes(read_item, value)

    return SafeFileSystemReader, SafeLoadPlanner


def dcp_load(state_dict: dict[str, Any], checkpoint: str | os.PathLike) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=checkpoint)``, except that
    nothing in the folder can run code: the metadata is unpickled with the allow-list and the
    non-tensor values are checked with ``weights_only=True`` (tensors already are).

    Raises :class:`UnsafePickleError` (a one-line :class:`~nrl_core.errors.ConfigError`
    naming the file) for a planted or damaged file.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    # DCP turns a failed metadata read into "metadata is None" (it falls back to rank-local
    # metadata), so a refused .metadata is reported here first, in its own words.
    if (Path(checkpoint) / ".metadata").is_file():
        load_dcp_metadata(checkpoint)
    reader_cls, planner_cls = _dcp_classes()
    planner = planner_cls()
    planner.checkpoint = str(checkpoint)
    try:
        dcp.load(state_dict, storage_reader=reader_cls(checkpoint), planner=planner)
    except CheckpointException as exc:
        # DCP wraps each rank's error with its traceback; ours is the one line to show.
        inners = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        for inner in inners:
            if isinstance(inner, UnsafePickleError):
                raise UnsafePickleError(str(inner)) from None
        # A shard cut short or damaged: CheckpointException is a BaseException, so callers'
        # `except Exception` would miss it and print DCP's per-rank tracebacks.
        inner = inners[0] if inners else exc
        first = (str(inner).strip().splitlines() or [""])[0][:200]
        raise UnsafePickleError(
            f"{checkpoint} cannot be read ({type(inner).__name__}{': ' + first if first else ''}"
            "); its files are truncated or damaged: use another checkpoint"
        ) from None
