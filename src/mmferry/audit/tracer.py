"""The simulated device: run a function on CPU tensors that carry a placement tag.

Every value really lives on the CPU and every kernel really runs, so data-dependent code
(``for t, h, w in grid.tolist()``) takes the path it takes in production. A :class:`Tag`
on each tracked tensor says whether it *would* be on the device, which input fields it
derives from and whether it is pinned. Two interposition layers keep tags current:

* a ``TorchFunctionMode`` sees Python-level calls: it virtualises ``Tensor.device`` /
  ``is_cuda``, rewrites factories called with the device or ``pin_memory=True``, and
  handles transfers (``.to`` / ``.cuda`` / ``.cpu`` / ``.pin_memory``) and host reads that
  never reach aten (``.tolist()``, ``.numpy()``, printing);
* a ``TorchDispatchMode`` sees every aten op, including those inside composite ops: it
  propagates tags to outputs and applies the rules (device mixing, data-dependent
  output shapes, scalar reads, copies, writes racing an asynchronous copy).

A :class:`Tracer` holds the state of one audit; nothing is global, and leaving
:func:`Tracer.active` restores every piece of torch state it touched.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mmferry.audit.findings import Finding, describe
from mmferry.errors import UnauditableOpError

__all__ = ["Tag", "Tracer", "UnauditableOpError"]

aten = torch.ops.aten
_ATTR = "_mmferry_audit_tag"
_EMPTY: frozenset[str] = frozenset()
_CPU = torch.device("cpu")
_GETSET = torch._C.TensorBase.__dict__


class Tag:
    """Placement of one tensor: on the simulated device or not, the input fields its value
    derives from, and whether its memory is pinned. ``owner`` ties it to one audit."""

    __slots__ = ("device", "fields", "owner", "pinned")

    def __init__(self, owner: object, device: bool, fields: frozenset[str],
                 pinned: bool = False) -> None:
        self.owner = owner
        self.device = device
        self.fields = fields
        self.pinned = pinned


# -- op classification ------------------------------------------------------------------

_PLAIN, _NO_KERNEL, _COPY, _SCALAR, _INDEX, _REPEAT, _DYNAMIC, _SHAPE_ONLY, _CUSTOM = range(9)

_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
              aten._index_put_impl_.default}
_NO_KERNEL_OPS = {aten.detach.default, aten.alias.default, aten.lift_fresh.default,
                  aten.lift_fresh_copy.default, aten.sym_size.int, aten.sym_stride.int,
                  aten.sym_numel.default, aten.sym_storage_offset.default}
# Outputs whose values do not depend on the input's values (only its shape and device).
_SHAPE_ONLY_OPS = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
                   aten.full_like.default, aten.rand_like.default, aten.randn_like.default,
                   aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
                   aten.new_full.default, aten.new_empty_strided.default}
# Syncs on a GPU although neither tagged nor data-dependent on the CPU (torch PR #62092).
_SYNCING_OPS = {aten.multinomial.default}
# Dynamic-shape tags that are wrong or conditional; handled by their own rules.
_NOT_DYNAMIC = {aten.index.Tensor, aten.repeat_interleave.Tensor}
_BUILTIN_NAMESPACES = {"aten", "prims", "prim", "_c10d_functional", "profiler"}


@functools.cache
def _classify(func: Any) -> tuple[int, tuple[tuple[int, str], ...]]:
    schema = func._schema
    written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    if func is aten.copy_.default:
        return _COPY, written
    if func is aten._local_scalar_dense.default:
        return _SCALAR, written
    if func in _INDEX_OPS:
        return _INDEX, written
    if func is aten.repeat_interleave.Tensor:
        return _REPEAT, written
    if func in _SHAPE_ONLY_OPS:
        return _SHAPE_ONLY, written
    if func.is_view or func in _NO_KERNEL_OPS:
        return _NO_KERNEL, written
    tags = func.tags
    if func in _SYNCING_OPS or (func not in _NOT_DYNAMIC and (
            torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags)):
        return _DYNAMIC, written
    if func.namespace not in _BUILTIN_NAMESPACES:
        return _CUSTOM, written
    return _PLAIN, written


def _tensors_in(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif type(a) is list or type(a) is tuple:
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


# -- where a finding happened -----------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# mmferry's own machinery is skipped; model code inside the package is user code.
_USER_CODE_IN_PACKAGE = (os.path.join(_PACKAGE_DIR, "models") + os.sep,
                         os.path.join(_PACKAGE_DIR, "audit", "examples.py"))
_skip_cache: dict[str, bool] = {}


def skipped_frame(filename: str) -> bool:
    """Whether ``filename`` is torch's or mmferry's machinery (not user code)."""
    skip = _skip_cache.get(filename)
    if skip is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        skip = (path.startswith(_TORCH_DIR) or path.startswith("<frozen")
                or path.endswith(os.sep + "contextlib.py")
                or (path.startswith(_PACKAGE_DIR) and not path.startswith(_USER_CODE_IN_PACKAGE)))
        _skip_cache[filename] = skip
    return skip


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def user_location() -> str:
    """``file:line`` of the innermost frame outside torch and mmferry's machinery."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not skipped_frame(name):
            return f"{_short(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _op_name(func: Any) -> str:
    """``namespace.name.overload`` of an aten-level op."""
    return f"{func.namespace}.{func.__name__}"


def _api_name(func: Any) -> str:
    if isinstance(func, torch._ops.OpOverload):
        return f"torch.ops.{_op_name(func)}"
    if isinstance(func, torch._ops.OpOverloadPacket):
        return f"torch.ops.{func._qualified_op_name.replace('::', '.')}"
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":
        return f"Tensor.{owner.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    for prefix, short in (("TensorBase.", "Tensor."), ("_VariableFunctionsClass.", "torch.")):
        if name.startswith(prefix):
            return short + name[len(prefix):]
    if module in ("torch._C._nn", "torch.nn.functional"):
        return f"F.{name}"
    if module.startswith("torch") and "." not in name:
        return f"torch.{name}"
    return name


# -- the tracer -------------------------------------------------------------------------


class Tracer:
    """State of one audit: tags, findings, asynchronous copies in flight.

    ``placements`` maps each tracked field to "host", "device" or "both" (used for fix
    hints); ``device`` is the simulated device (e.g. ``torch.device("cuda", 0)``).
    """

    def __init__(self, device: torch.device, placements: Mapping[str, str]) -> None:
        self.owner = object()
        self.device = device
        self.placements = dict(placements)
        self.ops = 0
        self.findings: dict[tuple[str, tuple[str, ...], str, str], list[Any]] = {}
        # storage of a pinned source -> (copy location, the source's base, weakly)
        self.pending_h2d: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = {}
        self.pending_d2h: dict[int, str] = {}  # storage of an async D2H result -> location
        self.api: Any = None  # the Python-level call the current aten ops belong to
        self.aten_op: Any = None
        self.api_args: tuple[Any, ...] = ()  # its arguments (for ops without tensor inputs)
        self.api_device: bool | None = None  # its device, when known
        self.call = 0
        self._seen: dict[tuple[str, tuple[str, ...], str, str], int] = {}
        self._tags: dict[tuple[bool, frozenset[str], bool], Tag] = {}
        self._retagged: list[weakref.ref[torch.Tensor]] = []

    # -- tags -----------------------------------------------------------------------

    def tag_of(self, t: torch.Tensor) -> Tag | None:
        tag = getattr(t, _ATTR, None)
        return tag if tag is not None and tag.owner is self.owner else None

    def make_tag(self, device: bool, fields: frozenset[str], pinned: bool = False) -> Tag:
        key = (device, fields, pinned)
        tag = self._tags.get(key)
        if tag is None:
            tag = self._tags[key] = Tag(self.owner, device, fields, pinned)
        return tag

    def set_tag(self, t: torch.Tensor, tag: Tag | None, *, foreign: bool = False) -> None:
        """Tag ``t``; ``foreign`` marks a tensor that existed before the audit, whose tag
        is removed when the audit ends."""
        if foreign and getattr(t, _ATTR, None) is None:
            self._retagged.append(weakref.ref(t))
        setattr(t, _ATTR, tag)

    def place(self, value: Any, device: bool, fields: frozenset[str]) -> Any:
        """``value`` as the engine would hand it over: tensors (also inside lists) become
        tagged copies, so the caller's tensors are never written."""
        if isinstance(value, torch.Tensor):
            t = value.detach().clone()
            setattr(t, _ATTR, self.make_tag(device, fields))
            return t
        if isinstance(value, list | tuple):
            return type(value)(self.place(v, device, fields) for v in value)
        return value

    def forget(self) -> None:
        """Remove the tags this audit left on tensors that outlive it."""
        for ref in self._retagged:
            t = ref()
            if t is not None and getattr(t, _ATTR, None) is not None:
                delattr(t, _ATTR)
        self._retagged.clear()

    def call_on_device(self) -> bool:
        """Whether the current Python-level call has device inputs: an op without tensor
        inputs inside it (a factory in a composite) creates its tensor there."""
        if self.api_device is None:
            self.api_device = any(
                (tag := self.tag_of(t)) is not None and tag.device
                for t in _tensors_in(self.api_args, {}))
        return self.api_device

    # -- findings ---------------------------------------------------------------------

    def report(self, kind: str, fields: frozenset[str], *, op: str | None = None,
               detail: str = "", note: str = "") -> None:
        names = tuple(sorted(fields))
        if op is None:
            op = _api_name(self.api) if self.api is not None else _op_name(self.aten_op)
        where = user_location()
        key = (kind, names, op, where)
        if self.api is not None:
            # Several aten ops of one Python-level call count once.
            if self._seen.get(key) == self.call:
                return
            self._seen[key] = self.call
        rec = self.findings.get(key)
        if rec is None:
            message = describe(kind, op, names, self.placements, detail, note)
            self.findings[key] = [1, message]
        else:
            rec[0] += 1

    def finding_list(self) -> list[Finding]:
        return [Finding(kind, fields, op, loc, msg, count)
                for (kind, fields, op, loc), (count, msg) in self.findings.items()]

    def sync_point(self) -> None:
        """The host waited for the device: every asynchronous copy has completed."""
        self.pending_h2d.clear()
        self.pending_d2h.clear()

    def host_sync(self, fields: frozenset[str], **kw: Any) -> None:
        self.report("host_sync", fields, **kw)
        self.sync_point()

    def host_read(self, t: torch.Tensor, tag: Tag | None, op: str | None = None) -> None:
        """``t`` (a host tensor) is read on the host: a race if an async D2H writes it."""
        copied_at = self.pending_d2h.get(_storage(t)) if self.pending_d2h else None
        if copied_at is not None:
            self.report("async_copy_race", tag.fields if tag else _EMPTY, op=op, detail="read",
                        note="reads the result of the non_blocking device-to-host copy at "
                        f"{copied_at} before any sync")

    # -- transfers (.to / .cuda / .cpu / copy_) ------------------------------------------

    def upload(self, src: torch.Tensor, tag: Tag | None, non_blocking: bool, op: str) -> None:
        """Rules for a host-to-device copy of ``src``."""
        fields = tag.fields if tag else _EMPTY
        self.host_read(src, tag, op)
        if not non_blocking:
            self.report("implicit_h2d", fields, op=op)
            self.sync_point()
        elif not (tag and tag.pinned) or not _is_dense(src):
            why = ("unpinned" if not (tag and tag.pinned) else "") + (
                ", non-dense" if not _is_dense(src) else "")
            self.report("pageable_async_copy", fields, op=op, note=f"source is {why.strip(', ')}")
        else:
            base = src if src._base is None else src._base
            self.pending_h2d[_storage(src)] = (user_location(), weakref.ref(base))

    def download(self, tag: Tag, non_blocking: bool, op: str) -> bool:
        """Rules for a device-to-host copy; returns whether the result is in flight."""
        if non_blocking:
            return True
        self.host_sync(tag.fields, op=op)
        return False

    def transfer(self, t: torch.Tensor, to_device: bool, dtype: torch.dtype | None,
                 non_blocking: bool, copy: bool, op: str,
                 memory_format: torch.memory_format | None = None) -> torch.Tensor:
        """``t.to(...)`` towards the device (``to_device``) or the host."""
        tag = self.tag_of(t)
        on_device = bool(tag and tag.device)
        layout: dict[str, Any] = {} if memory_format is None else {"memory_format": memory_format}
        if to_device == on_device:
            return t.to(dtype=dtype, copy=copy, **layout)
        if to_device:
            self.upload(t, tag, non_blocking, op)
            in_flight = False
        else:
            assert tag is not None
            in_flight = self.download(tag, non_blocking, op)
        out = t.to(dtype=dtype, copy=True, **layout)
        self.set_tag(out, self.make_tag(to_device, tag.fields if tag else _EMPTY))
        if in_flight:
            self.pending_d2h[_storage(out)] = user_location()
        return out

    # -- the aten-level rules ---------------------------------------------------------

    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.ops += 1
        self.aten_op = func
        kind, written = _classify(func)
        owner = self.owner
        tensors = _tensors_in(args, kwargs)
        tags: list[Tag | None] = []
        on_device = False
        fields = _EMPTY
        for t in tensors:
            tag = getattr(t, _ATTR, None)
            if tag is not None and tag.owner is not owner:
                tag = None
            tags.append(tag)
            if tag is not None:
                if tag.device:
                    on_device = True
                f = tag.fields
                if f and f is not fields:
                    fields = f if not fields else (fields if f <= fields else fields | f)

        if kind in (_PLAIN, _CUSTOM):
            if on_device:
                self._check_mixing(func, tensors, tags)
        elif kind == _COPY:
            self._copy(args, kwargs, tags)
        elif kind == _SCALAR:
            if on_device:
                self.host_sync(fields)
            else:
                self.host_read(tensors[0], tags[0])
        elif kind == _INDEX:
            self._index(args, tags, tensors)
        elif kind == _REPEAT:
            if on_device and kwargs.get("output_size") is None:
                self.host_sync(fields, note="repeat_interleave with tensor repeats and no "
                               "output_size")
        elif kind == _DYNAMIC and on_device:
            self._check_mixing(func, tensors, tags)
            self.host_sync(fields, note=f"the output shape of {_op_name(func)} depends on "
                           "the data")
        if written and self.pending_h2d:
            self._check_write(args, kwargs, written)
        if self.pending_d2h and not on_device and kind != _SCALAR:
            for t, tag in zip(tensors, tags, strict=True):
                self.host_read(t, tag)

        try:
            out = func(*args, **kwargs)
        except NotImplementedError as e:
            if kind != _CUSTOM:
                raise
            name = f"{func.namespace}::{func._schema.name.split('::')[-1]}"
            raise UnauditableOpError(
                f"custom op {name} has no CPU kernel, so the audit cannot run it (called at "
                f"{user_location()}); register a CPU reference kernel: "
                f"torch.library.register_kernel({name!r}, 'cpu', reference_fn)") from e

        if kind == _SHAPE_ONLY:
            fields = _EMPTY
        out_device = on_device or (not tensors and self.call_on_device())
        if written:
            self._taint_written(args, kwargs, written, fields)
        if not (out_device or fields):
            return out
        pinned = kind == _NO_KERNEL and bool(tags) and tags[0] is not None and tags[0].pinned
        new_tag = self.make_tag(out_device, fields, pinned)
        if isinstance(out, torch.Tensor):
            if not any(out is t for t in tensors):
                setattr(out, _ATTR, new_tag)
        elif isinstance(out, tuple | list):
            for o in out:
                if isinstance(o, torch.Tensor) and not any(o is t for t in tensors):
                    setattr(o, _ATTR, new_tag)
        return out

    def _check_mixing(self, func: Any, tensors: list[torch.Tensor],
                      tags: list[Tag | None]) -> None:
        for t, tag in zip(tensors, tags, strict=True):
            # A 0-dim host tensor is passed to device kernels as a scalar (PyTorch's rule).
            if (tag is None or not tag.device) and t.dim() != 0:
                self.report("device_mismatch", tag.fields if tag else _EMPTY,
                            note=f"a host tensor of shape {tuple(t.shape)} in {_op_name(func)}")

    def _copy(self, args: tuple[Any, ...], kwargs: dict[str, Any],
              tags: list[Tag | None]) -> None:
        dst, src = args[0], args[1]
        dst_tag, src_tag = tags[0], tags[1]
        dst_dev, src_dev = bool(dst_tag and dst_tag.device), bool(src_tag and src_tag.device)
        if dst_dev == src_dev or (not src_dev and src.dim() == 0):
            return  # same side, or a host scalar filled into a device tensor
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        op = _api_name(self.api) if self.api is not None else "Tensor.copy_"
        if dst_dev:
            self.upload(src, src_tag, non_blocking, op)
        elif src_tag is not None and self.download(src_tag, non_blocking, op):
            self.pending_d2h[_storage(dst)] = user_location()

    def _index(self, args: tuple[Any, ...], tags: list[Tag | None],
               tensors: list[torch.Tensor]) -> None:
        base_tag = tags[0]
        base_dev = bool(base_tag and base_tag.device)
        indices = [i for i in args[1] if isinstance(i, torch.Tensor)]
        bool_mask = [i for i in indices if i.dtype in (torch.bool, torch.uint8)]
        others = tensors[1:]
        if base_dev:
            for t, tag in zip(others, tags[1:], strict=True):
                if (tag is None or not tag.device) and t.dim() != 0:
                    self.report("implicit_h2d", tag.fields if tag else _EMPTY,
                                note="a host tensor indexes or fills a device tensor")
                    self.sync_point()
            dev_masks = [self.tag_of(m) for m in bool_mask]
            masked = [m for m in dev_masks if m is not None and m.device]
            if masked:
                self.host_sync(frozenset().union(*(m.fields for m in masked)),
                               note="boolean-mask indexing runs nonzero")
        else:
            for t, tag in zip(others, tags[1:], strict=True):
                if tag is not None and tag.device and t.dim() != 0:
                    self.report("device_mismatch", tag.fields,
                                note="a device tensor indexes or fills a host tensor")

    def _check_write(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                     written: tuple[tuple[int, str], ...]) -> None:
        for i, name in written:
            t = args[i] if i < len(args) else kwargs.get(name)
            pending = self.pending_h2d.get(_storage(t)) if isinstance(t, torch.Tensor) else None
            if pending is None:
                continue
            copied_at, source = pending
            if source() is None:
                # The source is gone and this is new memory at its address: the simulation
                # recycles host memory at once, while on a GPU the caching host allocator
                # hands a pinned block out again only after its copies have completed.
                del self.pending_h2d[_storage(t)]
            else:
                tag = self.tag_of(t)
                self.report("async_copy_race", tag.fields if tag else _EMPTY,
                            note=f"writes the pinned source of the non_blocking copy at "
                            f"{copied_at}, which may still be in flight")

    def _taint_written(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                       written: tuple[tuple[int, str], ...], fields: frozenset[str]) -> None:
        if not fields:
            return
        for i, name in written:
            t = args[i] if i < len(args) else kwargs.get(name)
            if not isinstance(t, torch.Tensor):
                continue
            tag = self.tag_of(t)
            if tag is None:
                self.set_tag(t, self.make_tag(False, fields), foreign=True)
            elif not fields <= tag.fields:
                self.set_tag(t, self.make_tag(tag.device, tag.fields | fields, tag.pinned))

    # -- activation -------------------------------------------------------------------

    @contextlib.contextmanager
    def active(self, module_tensors: list[torch.Tensor]) -> Iterator[None]:
        """Run the body on the simulated device: tag the module's tensors as device
        tensors, make ``torch.cuda.synchronize`` a sync point, enter both modes. Leaves
        torch as it found it, also when the body raises."""
        saved = [(t, getattr(t, _ATTR, None)) for t in module_tensors]
        device_tag = self.make_tag(True, _EMPTY)
        patched = _sync_functions()
        originals = [(mod, name, getattr(mod, name)) for mod, name in patched]
        try:
            for t in module_tensors:
                setattr(t, _ATTR, device_tag)
            for mod, name in patched:
                setattr(mod, name, self._sync_stub)
            with torch.no_grad(), _FunctionMode(self), _DispatchMode(self):
                yield
        finally:
            for mod, name, original in originals:
                setattr(mod, name, original)
            for t, old in saved:
                if old is None:
                    if getattr(t, _ATTR, None) is not None:
                        delattr(t, _ATTR)
                else:
                    setattr(t, _ATTR, old)
            self.forget()

    def _sync_stub(self, *args: Any, **kwargs: Any) -> None:
        self.sync_point()


def _sync_functions() -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = [(torch.cuda, "synchronize")]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        out.append((accelerator, "synchronize"))
    return out


# -- the Python-level layer -------------------------------------------------------------

_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
_METADATA = {
    _GETSET[name].__get__ for name in (
        "shape", "dtype", "ndim", "layout", "requires_grad", "is_sparse", "is_quantized",
        "is_meta", "itemsize", "nbytes", "names", "is_leaf", "grad_fn", "T", "mT")
    if name in _GETSET
} | {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.nelement,
    torch.Tensor.ndimension, torch.Tensor.storage_offset, torch.Tensor.untyped_storage,
    torch.Tensor.data_ptr,
}
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__,
               torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__}


def _device_type(value: Any) -> str:
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, int):
        return "cuda"
    return torch.device(value).type


class _FunctionMode(TorchFunctionMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.device_type = tracer.device.type
        self.handlers: dict[Any, Callable[..., Any]] = {
            _GETSET["device"].__get__: self._device,
            _GETSET["is_cuda"].__get__: self._is_cuda,
            _GETSET["is_cpu"].__get__: self._is_cpu,
            _GETSET["data"].__get__: self._data,
            torch.Tensor.get_device: self._get_device,
            torch.Tensor.to: self._to,
            torch.Tensor.cuda: self._cuda,
            torch.Tensor.cpu: self._cpu,
            torch.Tensor.pin_memory: self._pin_memory,
            torch.Tensor.is_pinned: self._is_pinned,
            torch.Tensor.new_tensor: self._new_tensor,
            torch.tensor_split: self._tensor_split,
            torch.Tensor.tensor_split: self._tensor_split,
        }
        for f in _METADATA:
            self.handlers[f] = self._passthrough
        for f in _HOST_READS:
            self.handlers[f] = self._host_read

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        handler = self.handlers.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if "device" in kwargs or kwargs.get("pin_memory"):
            return self._factory(func, args, kwargs)
        return self._call(func, args, kwargs)

    def _call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              device: bool | None = None) -> Any:
        tr = self.tracer
        prev = tr.api, tr.api_args, tr.api_device
        tr.api, tr.api_args, tr.api_device = func, (*args, *kwargs.values()), device
        tr.call += 1
        try:
            return func(*args, **kwargs)
        finally:
            tr.api, tr.api_args, tr.api_device = prev

    def _is_sim(self, device: Any) -> bool:
        return device is not None and _device_type(device) == self.device_type

    # -- getters --------------------------------------------------------------------

    def _passthrough(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)

    def _on_device(self, t: torch.Tensor) -> bool:
        tag = self.tracer.tag_of(t)
        return tag is not None and tag.device

    def _device(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.tracer.device if self._on_device(args[0]) else _CPU

    def _is_cuda(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return self._on_device(args[0]) and self.device_type == "cuda"

    def _is_cpu(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return not self._on_device(args[0])

    def _get_device(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return (self.tracer.device.index or 0) if self._on_device(args[0]) else -1

    def _data(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args)
        tag = self.tracer.tag_of(args[0])
        if tag is not None:
            self.tracer.set_tag(out, tag)
        return out

    def _is_pinned(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        tag = self.tracer.tag_of(args[0])
        return bool(tag and tag.pinned and not tag.device)

    # -- host reads that never reach aten ---------------------------------------------

    def _host_read(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tr = self.tracer
        t = args[0]
        tag = tr.tag_of(t)
        op = _api_name(func)
        if tag is not None and tag.device:
            tr.host_sync(tag.fields, op=op)
        else:
            tr.host_read(t, tag, op)
        with torch._C._DisableTorchDispatch():
            return func(*args, **kwargs)

    # -- transfers ------------------------------------------------------------------

    def _to(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t, rest = args[0], args[1:]
        kw = dict(kwargs)
        copy = bool(kw.pop("copy", False))
        memory_format = None
        if rest and isinstance(rest[0], torch.Tensor):
            other = rest[0]
            device: Any = self.tracer.device if self._on_device(other) else _CPU
            dtype = other.dtype
            non_blocking = bool(rest[1] if len(rest) > 1 else kw.get("non_blocking", False))
            copy = copy or bool(rest[2] if len(rest) > 2 else False)
            memory_format = kw.get("memory_format")
        else:
            # Positional copy: to(device, dtype, non_blocking, copy) / to(dtype, non_blocking, copy)
            n = 3 if rest and isinstance(rest[0], torch.dtype) else 4
            if len(rest) >= n:
                copy = copy or bool(rest[n - 1])
                rest = rest[:n - 1]
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kw)
        if device is None or device.type not in (self.device_type, "cpu"):
            return self._call(func, args, kwargs)  # no device change: an ordinary op
        return self.tracer.transfer(t, device.type == self.device_type, dtype, non_blocking,
                                    copy, _api_name(func), memory_format)

    def _cuda(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        return self.tracer.transfer(args[0], True, None, non_blocking, False, "Tensor.cuda",
                                    kwargs.get("memory_format"))

    def _cpu(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.tracer.transfer(args[0], False, None, False, False, "Tensor.cpu")

    def _pin_memory(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tr = self.tracer
        t = args[0]
        tag = tr.tag_of(t)
        if tag is not None and tag.device:
            tr.report("device_mismatch", tag.fields, op="Tensor.pin_memory", detail="needs_host",
                      note="pin_memory() of a device tensor")
            return t
        if tag is not None and tag.pinned:
            return t
        tr.host_read(t, tag, "Tensor.pin_memory")
        with torch._C._DisableTorchDispatch():
            out = t.clone()
        tr.set_tag(out, tr.make_tag(False, tag.fields if tag else _EMPTY, True))
        return out

    def _tensor_split(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The split points are read on the host; PyTorch rejects a device tensor there.
        points = args[1] if len(args) > 1 else kwargs.get("indices_or_sections",
                                                          kwargs.get("tensor_indices_or_sections"))
        tr = self.tracer
        if isinstance(points, torch.Tensor):
            tag = tr.tag_of(points)
            if tag is not None and tag.device:
                tr.report("device_mismatch", tag.fields, op=_api_name(func), detail="needs_host",
                          note="the split points must be a host tensor")
                with torch._C._DisableTorchDispatch():
                    return self._call(func, args, kwargs)
        return self._call(func, args, kwargs)

    # -- factories ------------------------------------------------------------------

    def _factory(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tr = self.tracer
        device = kwargs.get("device")
        if device is not None and not self._is_sim(device) and _device_type(device) != "cpu":
            return self._call(func, args, kwargs)
        to_device = self._is_sim(device)
        pinned = bool(kwargs.get("pin_memory")) and not to_device
        kw = dict(kwargs)
        if to_device:
            kw["device"] = "cpu"
        kw.pop("pin_memory", None)
        data = args[0] if args else kw.get("data")
        if func in _DATA_FACTORIES:
            return self._from_data(func, args, kw, data, to_device, pinned)
        out = self._call(func, args, kw, device=to_device)
        _tag_outputs(tr, out, tr.make_tag(to_device, _EMPTY, pinned))
        return out

    def _from_data(self, func: Any, args: tuple[Any, ...], kw: dict[str, Any], data: Any,
                   to_device: bool, pinned: bool) -> Any:
        """``torch.tensor(data, device=...)`` and friends: a copy from ``data``."""
        tr = self.tracer
        op = _api_name(func)
        src = data if isinstance(data, torch.Tensor) else None
        src_tag = tr.tag_of(src) if src is not None else None
        src_dev = bool(src_tag and src_tag.device)
        if src_tag is not None:
            fields = src_tag.fields
        else:
            inner = [tr.tag_of(t) for t in _tensors_in((data,), {})]
            fields = frozenset().union(*(t.fields for t in inner if t is not None))
        if to_device and not src_dev:
            if src is not None:
                tr.upload(src, src_tag, False, op)
            else:
                # Data from Python lists or arrays lives in pageable host memory.
                tr.report("implicit_h2d", fields, op=op)
                tr.sync_point()
        elif src_dev and not to_device:
            tr.host_sync(fields, op=op)
        out = self._call(func, args, kw, device=to_device)
        if src is not None and out is src:
            if to_device == src_dev and not pinned:
                return out  # as_tensor of a tensor already in place returns it
            with torch._C._DisableTorchDispatch():
                out = out.clone()
        tr.set_tag(out, tr.make_tag(to_device, fields, pinned))
        return out

    def _new_tensor(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        base = args[0]
        device = kwargs.get("device")
        to_device = self._on_device(base) if device is None else self._is_sim(device)
        kw = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
        pinned = bool(kwargs.get("pin_memory")) and not to_device
        return self._from_data(func, args, kw, args[1] if len(args) > 1 else kw.get("data"),
                               to_device, pinned)


def _tag_outputs(tr: Tracer, out: Any, tag: Tag) -> None:
    if isinstance(out, torch.Tensor):
        tr.set_tag(out, tag)
    elif isinstance(out, tuple | list):
        for o in out:
            if isinstance(o, torch.Tensor):
                tr.set_tag(o, tag)


class _DispatchMode(TorchDispatchMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return self.tracer.on_op(func, args, kwargs or {})
