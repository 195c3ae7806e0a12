"""Reading a model's own checkpoint: the model built on the meta device, each weight put on its storage.

The loading half of :func:`placement_opt.load` (which then calls :func:`placement_opt.dispatch`):

* :func:`meta_model` builds the model from ``config.json`` with every parameter on the meta
  device (buffers stay real: rotary tables are computed at init and are not in checkpoints);
* :func:`checkpoint_index` maps every tensor name to its safetensors shard, mapped once;
* :func:`materialize` puts each tensor on its plan's storage device without ever holding the
  model twice: CPU- and disk-stored tensors in the checkpoint's dtype are views of the mapped
  shard, GPU tensors are read one by one, casts happen one tensor (disk: one unit) at a time.

:class:`Slot` and :func:`collect_slots` (one entry per distinct tensor, tied names together) are
shared with the dispatcher; a tensor's unit is :func:`placement_opt.model.graph.covering_key`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import DispatchError, ModelSpecError, first_line
from ..model._context import in_media_encoder
from ..model._source import check_layer_counts
from ..model._ties import checkpoint_safetensors, untie_stored_apart
from ..model.dtypes import as_torch_dtype
from ..model.graph import covering_key
from ..plan import Plan
from ..progress import Bar, bar
from ..units import format_bytes
from ._conversion import Converted
from ._expert_groups import source_rows
from .offload import OffloadStore, SafetensorsFile

__all__ = ["Slot", "collect_slots", "checkpoint_files", "checkpoint_index", "meta_model",
           "materialize", "model_class", "needs_conversion", "learned_positions"]

#: How a Python caller is asked for an offload folder (``run`` rewrites it into its ``--offload-dir`` flag).
OFFLOAD_DIR_HINT = "offload_dir='some/dir'"


@dataclass(eq=False)
class Slot:
    """One distinct parameter or buffer tensor: its names and what dispatch changed."""

    names: list[str]
    tensor: torch.Tensor
    """The Parameter or buffer object itself (identity kept; only ``.data`` is swapped)."""
    original_device: torch.device
    stored: torch.Tensor | None = None
    """The tensor that holds the weights between forwards (pinned host, mmap view, ...)."""
    foreign: bool = False
    """True when ``stored`` is not the original memory (mmap, pinned copy): restore by copying."""
    original_layout: tuple[torch.Size, tuple[int, ...]] | None = None
    """Shape and strides of a tensor not laid out contiguously (a transposed buffer), which a copy restores."""


def collect_slots(model: nn.Module) -> list[Slot]:
    """Every distinct tensor of the model with all its names (tied weights appear once)."""
    by_id: dict[int, Slot] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        slot = by_id.get(id(tensor))
        if slot is None:
            by_id[id(tensor)] = Slot(names=[name], tensor=tensor, original_device=tensor.device,
                                     original_layout=_permuted_layout(tensor))
        else:
            slot.names.append(name)
    return list(by_id.values())


def _permuted_layout(tensor: torch.Tensor) -> tuple[torch.Size, tuple[int, ...]] | None:
    """``tensor``'s shape and strides where it is a dense tensor laid out in another order of its dimensions (a
    transpose), which an empty tensor of those strides can hold; None where it is contiguous, or has gaps or
    overlaps (an expanded view): a contiguous copy is the best its restore can do."""
    if tensor.is_contiguous():
        return None
    order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return (tensor.shape, tensor.stride()) if tensor.permute(order).is_contiguous() else None


def needs_conversion(model: nn.Module, sources: Mapping[str, Any]) -> bool:
    """True when some parameter has no key of its own in the checkpoint (a layout transformers converts); an expert
    group's weights are rows of their whole weight's key."""
    return any(not _in_checkpoint(model, slot, sources) for slot in collect_slots(model)
               if slot.tensor.device.type == "meta")


def _in_checkpoint(model: nn.Module, slot: Slot, sources: Mapping[str, Any]) -> bool:
    if any(n in sources for n in slot.names):
        return True
    rows = source_rows(model, slot.names[0])
    return rows is not None and rows[0] in sources


def checkpoint_files(root: Path) -> list[Path]:
    """The checkpoint's safetensors files (:func:`~placement_opt.model._ties.checkpoint_safetensors`: an offload
    store's files in its folder are not the checkpoint's)."""
    found = checkpoint_safetensors(root)
    if not found:
        raise DispatchError(_no_checkpoint(root))
    return found


def _no_checkpoint(root: Path) -> str:
    """What a directory without a safetensors checkpoint lacks, and how to make one."""
    if not root.is_dir():
        return (f"{root} is not a directory: loading needs the weights in a local directory; save them with "
                f"model.save_pretrained(path), or download a hub model first (huggingface_hub.snapshot_download)")
    if bins := sorted(p.name for p in root.glob("*.bin")):
        return (f"{root} holds PyTorch .bin weights ({', '.join(bins[:3])}{', ...' if len(bins) > 3 else ''}), and "
                f"placement_opt reads safetensors only (it maps them; it never unpickles): write them once as "
                f"safetensors with AutoModelForCausalLM.from_pretrained(path).save_pretrained(path), whose default "
                f"format that is")
    return (f"{root} has no safetensors checkpoint (model.safetensors or an index): loading needs the weights in a "
            f"local directory; save them with model.save_pretrained(path), or download a hub model first "
            f"(huggingface_hub.snapshot_download)"
            + ("; a config alone can be planned (placement_opt.solve, placement-opt plan)"
               if (root / "config.json").is_file() else ""))


def learned_positions(model: nn.Module) -> tuple[str, int] | None:
    """(the module's name, the positions it holds) of a model's smallest learned position table (GPT-2's ``wpe``,
    OPT's ``embed_positions`` less its offset), or None: rotary and ALiBi models have none and run at any length. A
    run past it fails at the table's lookup, mid-generation. A multimodal model's media encoder (a CLIP tower's
    577 patch positions) holds no text positions: its tables are not counted."""
    tables = [(module.num_embeddings - int(getattr(module, "offset", 0) or 0), name)
              for name, module in model.named_modules()
              if isinstance(module, nn.Embedding) and ("pos" in (leaf := name.rsplit(".", 1)[-1]) or leaf == "wpe")
              and not in_media_encoder(name)]
    return (min(tables)[1], min(tables)[0]) if tables else None


def meta_model(root: Path, dtype: torch.dtype | str | None) -> nn.Module:
    """The model with parameters on the meta device and buffers real (they are not all in checkpoints)."""
    import transformers

    try:
        config = untie_stored_apart(transformers.AutoConfig.from_pretrained(root), root)  # as from_pretrained unties
    except Exception as exc:  # transformers' ValueError, OSError, JSON errors: the config is the user's to fix
        raise ModelSpecError(f"cannot read the transformers config of {root}: {first_line(exc)}; check "
                             f"{root / 'config.json'} (save it again with model.save_pretrained)") from None
    check_layer_counts(config, str(root / "config.json"))
    cls = model_class(config)
    wanted = as_torch_dtype(dtype or getattr(config, "dtype", None) or torch.float32)
    try:
        with _params_on_meta():
            if cls is None:  # a config.json without "architectures" (written by config.save_pretrained alone)
                return transformers.AutoModelForCausalLM.from_config(config, dtype=wanted)
            return cls._from_config(config, dtype=wanted) if hasattr(cls, "_from_config") else cls(config)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a config whose values build no model
        raise ModelSpecError(f"cannot build {cls.__name__ if cls else 'a model'} from {root / 'config.json'}: "
                             f"{first_line(exc)}; check the values there") from None


def model_class(config: Any) -> type | None:
    """The class a checkpoint's config names (``architectures[0]``) where transformers has it, else None (then
    :func:`meta_model` builds ``AutoModelForCausalLM``'s)."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    return getattr(transformers, arch, None) if arch else None


class _params_on_meta:
    """Context: every parameter registered inside is created on the meta device (buffers stay real)."""

    def __enter__(self) -> None:
        self.original = nn.Module.register_parameter

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            self.original(module, name, param)
            if param is not None and param.device.type != "meta":
                kind = type(module._parameters[name])
                module._parameters[name] = kind(module._parameters[name].to("meta"),
                                                requires_grad=param.requires_grad)

        nn.Module.register_parameter = register  # type: ignore[method-assign]

    def __exit__(self, *exc: Any) -> None:
        nn.Module.register_parameter = self.original  # type: ignore[method-assign]


def checkpoint_index(files: list[Path]) -> dict[str, tuple[SafetensorsFile, str]]:
    index: dict[str, tuple[SafetensorsFile, str]] = {}
    for path in files:
        file = SafetensorsFile(path)
        _check_complete(file)
        for key in file.keys():
            index[key] = (file, key)
    return index


def _check_complete(file: SafetensorsFile) -> None:
    """Refuse a shard shorter than its header says (a download or a copy cut off), before any weight is read."""
    needed = max((span.offset_bytes + span.nbytes for span in file.spans.values()), default=0)
    size = file.path.stat().st_size
    if size < needed:
        raise DispatchError(
            f"checkpoint file {file.path} is truncated: its header lists tensors up to byte {needed} but the file "
            f"has {size} bytes ({format_bytes(needed - size)} missing); download or save the checkpoint again")


def materialize(model: nn.Module, plan: Plan, sources: Mapping[str, tuple[SafetensorsFile, str]],
                 offload_dir: Any, *, converted: Mapping[str, Converted] | None = None, progress: bool | None = None,
                 description: str = "Loading weights") -> dict[str, tuple[SafetensorsFile, str]]:
    """Put every checkpoint tensor on its storage device; return the disk units' mapped sources.

    Weights stored on the CPU or on disk in the checkpoint's dtype are views of the mapped
    checkpoint (zero copy; copy-on-write, so the file never changes): CPU-stored ones are read
    ahead at once, disk-stored ones when first used. GPU weights and dtype conversions are read
    tensor by tensor; disk-stored tensors of another dtype are cast and written to
    ``offload_dir`` one unit at a time, so at most one unit of them is in RAM. ``converted`` (from
    :func:`~._conversion.conversions`) builds the weights the checkpoint stores in another layout, one at a
    time, when their turn comes; disk-stored ones go to ``offload_dir`` like cast ones.

    ``progress`` (see :mod:`placement_opt.progress`) shows a bar of the checkpoint's bytes on stderr.
    """
    slots = collect_slots(model)
    keys = [next((n for n in slot.names if n in sources), None) for slot in slots]
    built = converted or {}
    rows = _ExpertRows(model, sources, built)
    total = (sum(sources[k][0].spans[sources[k][1]].nbytes for k in keys if k is not None)
             + sum(rows.mapped_bytes(slot) for slot, key in zip(slots, keys, strict=True) if key is None)
             + sum(c.nbytes for c in built.values()))
    with bar(description, total, unit="bytes", progress=progress) as counted:
        disk_sources = _materialize(model, plan, sources, offload_dir, list(zip(slots, keys, strict=True)), counted,
                                    built, rows)
    return disk_sources


def _materialize(model: nn.Module, plan: Plan, sources: Mapping[str, tuple[SafetensorsFile, str]],
                 offload_dir: Any, slots: list[tuple[Slot, str | None]], counted: Bar,
                 converted: Mapping[str, Converted], rows: _ExpertRows) -> dict[str, tuple[SafetensorsFile, str]]:
    storage_of = {p.unit: p.storage for p in plan.placements}
    missing = []
    disk_sources: dict[str, tuple[SafetensorsFile, str]] = {}
    converting = _DiskConverter(offload_dir, disk_sources)
    for slot, key in slots:
        unit = covering_key(slot.names[0], storage_of)
        storage = storage_of.get(unit, plan.placements[0].storage if plan.placements else "cpu")
        if key is None and (part := rows.read(slot, storage)) is not None:  # an expert group's rows of a weight
            data, nbytes = part
            _replace(model, slot, data if storage in ("cpu", "disk") else data.to(storage))
            if storage == "disk":
                converting.add(unit or "", slot)
            counted.advance(nbytes)
            continue
        if key is None and (built := next((converted[n] for n in slot.names if n in converted), None)) is not None:
            _replace(model, slot, _converted(model, built, storage, slot.tensor))
            if storage == "disk":
                converting.add(unit or "", slot)
            counted.advance(built.nbytes)
            continue
        if key is None:  # a buffer computed at init (rotary tables) is not in checkpoints
            if slot.tensor.device.type == "meta":
                missing.append(slot.names[0])
            continue
        counted.advance(_place_stored(model, slot, sources[key], storage, unit, disk_sources, converting))
    converting.flush()
    if missing:
        raise DispatchError(f"{len(missing)} weight(s) are not in the checkpoint: {', '.join(missing[:5])}: "
                            f"is the directory a checkpoint of this architecture?")
    return disk_sources


def _place_stored(model: nn.Module, slot: Slot, source: tuple[SafetensorsFile, str], storage: str,
                  unit: str | None, disk_sources: dict[str, tuple[SafetensorsFile, str]],
                  converting: _DiskConverter) -> int:
    """The checkpoint bytes of a tensor the checkpoint holds under its own name (``source``), once it is on
    ``storage``: :func:`_materialize`'s common case, a mapped view, a read or a cast (disk: queued to be written)."""
    file, file_key = source
    _check_shape(slot.names[0], slot.tensor, file.spans[file_key].shape,
                 f"checkpoint tensor {file_key!r} in {file.path.name}")
    if storage in ("cpu", "disk") and file.spans[file_key].dtype == slot.tensor.dtype:
        data = file.tensor(file_key)
        if storage == "disk":
            disk_sources[slot.names[0]] = (file, file_key)
        else:
            file.prefetch((file_key,))
    else:
        data = _read(file, file_key, torch.device("cpu" if storage == "disk" else storage), slot.tensor.dtype)
    _replace(model, slot, data)
    if storage == "disk" and slot.names[0] not in disk_sources:
        converting.add(unit or "", slot)
    return file.spans[file_key].nbytes


def _share(nbytes: int, rows: int, start: int, end: int) -> int:
    """The bytes of rows ``[start, end)`` of a tensor of ``nbytes`` and ``rows`` rows."""
    return nbytes * (end - start) // max(rows, 1)


class _ExpertRows:
    """The weights of expert groups (:mod:`placement_opt.model.expert_groups`): rows of a whole checkpoint weight,
    read on the CPU in the model's dtype. A view of the mapped file where the dtype is the checkpoint's; a fused weight
    (built from one tensor per expert) is built once for all its groups and let go after its last rows are read
    (a layer's groups come in order, their projections interleaved: at most a layer's fused weights at once)."""

    def __init__(self, model: nn.Module, sources: Mapping[str, tuple[SafetensorsFile, str]],
                 converted: Mapping[str, Converted]) -> None:
        self.model, self.sources, self.converted = model, sources, converted
        self.built: dict[str, torch.Tensor] = {}

    def mapped_bytes(self, slot: Slot) -> int:
        """The checkpoint bytes of the rows ``slot`` will map from a fused checkpoint weight; 0 for any other."""
        found = source_rows(self.model, slot.names[0])
        return 0 if found is None or found[0] not in self.sources else self._mapped_share(*found)

    def _mapped_share(self, whole: str, start: int, end: int) -> int:
        span = self.sources[whole][0].spans[self.sources[whole][1]]
        return _share(span.nbytes, span.shape[0] if span.shape else 1, start, end)

    def read(self, slot: Slot, storage: str) -> tuple[torch.Tensor, int] | None:
        """``(rows on the CPU, checkpoint bytes they count for)``, or None for a tensor of no expert group; rows
        kept as a view for the CPU (``storage``) are read ahead, as whole CPU-stored tensors are."""
        found = source_rows(self.model, slot.names[0])
        if found is None:
            return None
        whole, start, end = found
        if whole in self.sources:
            file, key = self.sources[whole]
            span = file.spans[key]
            data = file.tensor(key)[start:end]
            nbytes = self._mapped_share(whole, start, end)
            if storage == "cpu" and span.dtype == slot.tensor.dtype:
                file.prefetch_rows(key, start, end)
        elif whole in self.converted:
            built = self.converted[whole]
            if whole not in self.built:
                self.built[whole] = _converted(self.model, built, "cpu", None)
            fused = self.built[whole]
            data = fused[start:end].clone()  # its own memory: the fused weight is let go after its last rows
            nbytes = _share(built.nbytes, fused.shape[0], start, end)
            if end >= fused.shape[0]:
                del self.built[whole]
        else:
            return None
        _check_shape(slot.names[0], slot.tensor, data.shape, f"rows {start}:{end} of checkpoint weight {whole!r}")
        return (data if data.dtype == slot.tensor.dtype else data.to(slot.tensor.dtype)), nbytes


def _converted(model: nn.Module, built: Converted, storage: str, like: torch.Tensor | None) -> torch.Tensor:
    """A weight the checkpoint stores in another layout, built now, in ``like``'s dtype, on its storage (disk: the
    CPU, until its unit is written to the offload store)."""
    keys = [key for _, key in built.sources]
    listed = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
    what = f"{built.name}, fused from {len(keys)} checkpoint tensors ({listed}),"
    try:
        data = built.build(model)
    except (RuntimeError, ValueError) as exc:  # tensors that do not stack: some missing, or of other shapes
        raise DispatchError(f"{what} cannot be built ({exc}): is the directory a complete checkpoint of this "
                            f"model's configuration (config.json)?") from exc
    if like is None:  # an expert group's whole weight: its rows are checked and cast one group at a time
        return data
    _check_shape(built.name, like, data.shape, what)
    data = data.to(like.dtype)
    return data if storage in ("cpu", "disk") else data.to(storage)


def _check_shape(name: str, expected: torch.Tensor, shape: Any, what: str) -> None:
    """Refuse a checkpoint tensor of another shape than the model's ``name`` (``expected``, on the meta device): a
    checkpoint of another configuration, or one missing some of the tensors a fused weight is made of."""
    if tuple(shape) != tuple(expected.shape):
        raise DispatchError(f"{what} has shape {list(shape)}, but the model's {name} has {list(expected.shape)}: "
                            f"is the directory a complete checkpoint of this model's configuration (config.json)?")


class _DiskConverter:
    """Writes cast or converted disk-stored tensors to the offload store unit by unit and maps them back."""

    def __init__(self, offload_dir: Any, disk_sources: dict[str, tuple[SafetensorsFile, str]]) -> None:
        self.offload_dir, self.disk_sources = offload_dir, disk_sources
        self.unit: str | None = None
        self.slots: list[Slot] = []

    def add(self, unit: str, slot: Slot) -> None:
        if unit != self.unit:
            self.flush()
            self.unit = unit
        self.slots.append(slot)

    def flush(self) -> None:
        if not self.slots:
            return
        if self.offload_dir is None:
            raise DispatchError(
                f"unit {self.unit!r} is stored on disk, but the checkpoint does not hold its weights as the model "
                f"uses them (another dtype than {self.slots[0].tensor.dtype}, a layout transformers converts at "
                f"load, or some rows of a layer's experts): pass {OFFLOAD_DIR_HINT} to keep them there"
            )
        store = OffloadStore(self.offload_dir)
        file = SafetensorsFile(store.write(self.unit or "", {s.names[0]: s.tensor.data for s in self.slots}))
        for slot in self.slots:
            slot.tensor.data = file.tensor(slot.names[0])
            self.disk_sources[slot.names[0]] = (file, slot.names[0])
        self.slots = []


def _read(file: SafetensorsFile, key: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One tensor from the file to ``device`` in ``dtype``, with no full-model intermediate."""
    span = file.spans[key]
    if device.type == "cpu":
        out = torch.empty(span.shape, dtype=span.dtype)
        file.read_into(key, out)
        return out if span.dtype == dtype else out.to(dtype)
    host = torch.empty(span.shape, dtype=span.dtype, pin_memory=torch.cuda.is_available())
    file.read_into(key, host)
    return host.to(device).to(dtype)


def _replace(model: nn.Module, slot: Slot, data: torch.Tensor) -> None:
    """Put ``data`` under every name of the slot (a new Parameter shared by all of them)."""
    old = slot.tensor
    new: torch.Tensor = nn.Parameter(data, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else data
    for name in slot.names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr in owner._parameters:
            owner._parameters[attr] = new  # type: ignore[assignment]
        else:
            owner._buffers[attr] = new
    slot.tensor = new
    slot.original_device = data.device
