"""Read the two pickled parts of a Megatron torch_dist checkpoint without running foreign code.

A torch_dist folder (`iter_NNNNNNN/`) holds `common.pt` (torch.save of the non-sharded entries:
Megatron-LM's saved arguments as an `argparse.Namespace`, the iteration, the checkpoint version)
and `.metadata` (torch.distributed.checkpoint's index, a plain pickle). Both are pickles, and an
actor checkpoint is input we did not write (docs/rules.md#bad-input-and-safety: nothing arbitrary is unpickled).

Why a restricted unpickler and not `torch.load(weights_only=True)` with an allow-list: real
Megatron-LM argument namespaces also hold enum members and small objects of Megatron's own
classes (e.g. the attention backend); weights_only refuses the whole file for any one of them, so
no real checkpoint would load. Here:
- `.metadata`: only torch.distributed.checkpoint's metadata classes, torch sizes / dtypes /
  layouts / memory formats and plain builtins; anything else is refused with the name of the
  global.
- `common.pt`: `argparse.Namespace`, plain builtins, torch dtypes and `OrderedDict` are rebuilt;
  any other global becomes an inert `Opaque` record (its module is never imported, nothing of it
  is called; its constructor arguments are kept as data). Tensors in it are not read (their
  storages become `Opaque` too). A field the caller needs that comes back `Opaque` is refused by
  the caller with a clear message.
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

from value_assets.core.errors import InputError

_SAFE_BUILTINS = frozenset(
    {
        "list",
        "dict",
        "set",
        "frozenset",
        "tuple",
        "int",
        "float",
        "complex",
        "str",
        "bytes",
        "bytearray",
        "bool",
        "slice",
        "range",
        "object",
    }
)


class Opaque:
    """Stand-in for an object of a class we do not rebuild; records what the pickle said."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __new__(cls, *args: Any, **kwargs: Any):  # NEWOBJ passes constructor args to __new__
        obj = super().__new__(cls)
        obj.args, obj.kwargs, obj.state = args, kwargs, None
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque({self.qualname})"


def _torch_global(name: str) -> Any:
    import torch

    obj = getattr(torch, name, None)
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or obj is torch.Size:
        return obj
    return None


def _layout(name: str) -> Any:
    import torch

    obj = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(obj, torch.layout):
        raise ValueError(f"not a torch layout: {name!r}")
    return obj


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, where: str, *, opaque: bool, allow_dcp: bool):
        super().__init__(file)
        self.where, self.opaque, self.allow_dcp = where, opaque, allow_dcp

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if (module, name) in (("collections", "OrderedDict"),):
            return collections.OrderedDict
        if (module, name) == ("argparse", "Namespace") and self.opaque:
            return argparse.Namespace
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout  # how torch pickles a layout: by its name
        if module == "torch":
            obj = _torch_global(name)
            if obj is not None:
                return obj
        if self.allow_dcp and module in (
            "torch.distributed.checkpoint.metadata",
            "torch.distributed.checkpoint.filesystem",
            "torch.distributed.checkpoint.planner",
        ):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # dataclasses and enums of torch's own checkpoint index
                return obj
        if self.opaque:
            return type(name, (Opaque,), {"qualname": f"{module}.{name}"})
        raise InputError(
            self.where,
            f"refusing to unpickle {module}.{name}: only torch.distributed.checkpoint "
            "metadata classes, torch sizes/dtypes and plain builtins are allowed in a checkpoint index",
        )

    def persistent_load(self, pid: Any) -> Any:
        if not self.opaque:
            raise InputError(self.where, "unexpected persistent id in a checkpoint index")
        return type("storage", (Opaque,), {"qualname": "torch storage (not read)"})(pid)


def load_common(path: Path) -> Any:
    """The object `torch.save` wrote to `path` (common.pt), rebuilt as described above."""
    return loads_common(path, str(path))


def loads_common(source: Path | bytes, where: str) -> Any:
    """`load_common` of a file or of bytes already read (megatron-core 0.19 keeps the common state
    inside the torch_dist files: the `torch.save` archive of a one-element list); `where` names it."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (OSError, zipfile.BadZipFile):
        raise InputError(where, "is not a torch zip archive (legacy pickle checkpoints are refused)") from None
    with zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise InputError(where, f"torch archive without exactly one data.pkl: {pkl}")
        data = zf.read(pkl[0])
    try:
        return _Unpickler(io.BytesIO(data), where, opaque=True, allow_dcp=False).load()
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed pickle: name it, never run it
        raise InputError(where, f"cannot be read: {type(exc).__name__}: {exc}") from None


def load_dcp_metadata(path: Path) -> Any:
    """torch.distributed.checkpoint's `.metadata` index at `path`, restricted as described above."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(str(path), "missing: not a torch_dist checkpoint folder") from None
    return loads_dcp_metadata(data, str(path))


def loads_dcp_metadata(data: bytes, where: str) -> Any:
    """The `.metadata` index from bytes already read (and checked) by the caller; `where` names
    them in errors."""
    try:
        return _Unpickler(io.BytesIO(data), where, opaque=False, allow_dcp=True).load()
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed index: name it, never run it
        raise InputError(where, f"cannot be read: {type(exc).__name__}: {exc}") from None
