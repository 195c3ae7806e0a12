"""Runtime rules: when not to place a model, and what each rank of a distributed run may plan for.

A placement that splits one model across devices inside one process is the wrong thing in a
distributed run: DDP, DeepSpeed and FSDP launch one process per GPU and replicate or shard the
model themselves, so ``device_map="auto"`` there fails or silently doubles memory. And a training
loop must not move a model that is already split across devices, that DeepSpeed or FSDP will
place, or that must be cast to fp16/bf16 before it is moved. This module encodes those rules,
following transformers' ``Trainer`` (``place_model_on_device``) and TRL (``device_map=None``
under ``MULTI_GPU``/``DEEPSPEED``); ``docs/distributed.md`` gives the reasons and examples.

* :func:`detect_context` reads the launch context (single process, DDP, DeepSpeed, FSDP) from the
  environment and the frameworks already initialised in this process.
* :func:`should_place_on_device` says whether a training/evaluation loop should ``.to(device)``.
* :func:`resolve_device_map` turns a ``device_map`` into what is valid on this rank.
* :func:`plan_for_context`, :func:`local_machine` and :func:`check_no_cross_rank_split` restrict a
  :class:`~placement_opt.devices.Machine` to the rank's own devices before solving.

Nothing here imports torch at module level; :func:`detect_context` imports it only to count GPUs.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ._units import format_bytes
from .devices import Device, Machine, as_machine, normalize_device_name, replace_device
from .errors import PlacementError

__all__ = [
    "KINDS",
    "STRATEGIES",
    "RuntimeContext",
    "Decision",
    "detect_context",
    "should_place_on_device",
    "resolve_device_map",
    "local_machine",
    "check_no_cross_rank_split",
    "plan_for_context",
]

logger = logging.getLogger("placement_opt")

#: Launch kinds :func:`detect_context` tells apart.
KINDS = ("single", "ddp", "deepspeed", "fsdp")
#: ``device_map`` strings that ask for a split of one model across the devices of one process.
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_TRUE = ("1", "true", "yes", "y", "on", "t")
_FRAMEWORK_PLACES = ("deepspeed", "fsdp")
#: Marks a CPU/disk whose capacity :func:`local_machine` already divided among a host's ranks.
_SHARE_TAG = "per-rank share"
_LABEL = {"single": "single process", "ddp": "DDP", "deepspeed": "DeepSpeed", "fsdp": "FSDP"}


@dataclass(frozen=True, kw_only=True)
class RuntimeContext:
    """How this process was launched, and which device is its own.

    Example::

        ctx = detect_context()
        ctx.kind, ctx.rank, ctx.world_size, ctx.local_device   # ('ddp', 1, 2, 'cuda:1')
    """

    kind: str = "single"
    """One of :data:`KINDS`: ``"single"``, ``"ddp"``, ``"deepspeed"`` or ``"fsdp"``."""
    world_size: int = 1
    """Processes in the whole run."""
    rank: int = 0
    """This process's global rank, ``0 <= rank < world_size``."""
    local_rank: int = 0
    """This process's rank among the processes on its host; picks its GPU."""
    local_world_size: int = 1
    """Processes on this host: they share its CPU RAM and disk."""
    local_device: str = "cpu"
    """The device this rank computes on: ``"cuda:N"`` or ``"cpu"``."""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage when the launcher says it (``ACCELERATE_DEEPSPEED_ZERO_STAGE``)."""
    source: str = ""
    """What the context was read from, for messages (``"env: WORLD_SIZE=2 (torchrun)"``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlacementError(f"runtime kind {self.kind!r} is not one of {KINDS}")
        problems = []
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            problems.append(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            problems.append(f"local rank {self.local_rank} is not in [0, local_world_size="
                            f"{self.local_world_size})")
        if self.local_world_size > self.world_size:
            problems.append(f"local_world_size {self.local_world_size} exceeds world_size {self.world_size}")
        if self.local_device != "cpu" and not self.local_device.startswith("cuda:"):
            problems.append(f"local_device {self.local_device!r} is neither 'cuda:N' nor 'cpu'")
        if problems:
            raise PlacementError("inconsistent runtime context (" + self.source + "): " + "; ".join(problems)
                                 + ". Check the launcher's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE")

    @property
    def is_distributed(self) -> bool:
        """True under DDP, DeepSpeed or FSDP (even with one process for the latter two)."""
        return self.kind != "single"

    @property
    def framework_places(self) -> bool:
        """True when DeepSpeed or FSDP moves and shards the model itself."""
        return self.kind in _FRAMEWORK_PLACES

    def describe(self) -> str:
        """``"rank 1 of 2 (DDP)"``, or ``"single process"``."""
        if self.kind == "single":
            return "single process"
        return f"rank {self.rank} of {self.world_size} ({_LABEL[self.kind]})"


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Whether to move a model to a device, and why. Truthy exactly when ``place`` is."""

    place: bool
    rule: str
    """Which rule decided: ``"place"``, ``"model_parallel"``, ``"deepspeed"``, ``"fsdp"``,
    ``"half_precision_eval"``."""
    reason: str
    """What, why and what to do, in one sentence or three."""

    def __bool__(self) -> bool:
        return self.place


# ---------------------------------------------------------------------------------------------
# detect_context
# ---------------------------------------------------------------------------------------------
def _flag(env: Mapping[str, str], key: str) -> bool:
    return str(env.get(key, "")).strip().lower() in _TRUE


def _int_env(env: Mapping[str, str], *keys: str) -> tuple[int | None, str | None]:
    """The first of ``keys`` that is set, as an int, and its name."""
    for key in keys:
        raw = env.get(key)
        if raw is None or str(raw).strip() == "":
            continue
        try:
            return int(str(raw).strip()), key
        except ValueError:
            raise PlacementError(
                f"environment variable {key}={raw!r} is not an integer: the launcher (torchrun, "
                f"deepspeed, accelerate, mpirun) sets it to a rank or a process count; unset or fix it"
            ) from None
    return None, None


@dataclass(frozen=True)
class _Ranks:
    world_size: int
    rank: int
    local_rank: int | None
    local_world_size: int | None
    source: str


def _env_ranks(env: Mapping[str, str]) -> _Ranks:
    world, world_key = _int_env(env, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    rank, _ = _int_env(env, "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    local_rank, _ = _int_env(env, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
    local_world, _ = _int_env(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                              "MPI_LOCALNRANKS")
    source = f"env: {world_key}={world}" if world_key else "env: no WORLD_SIZE"
    return _Ranks(world_size=world or 1, rank=rank or 0, local_rank=local_rank,
                  local_world_size=local_world, source=source)


def _env_kind(env: Mapping[str, str], ranks: _Ranks) -> tuple[str, str]:
    deepspeed = _flag(env, "ACCELERATE_USE_DEEPSPEED")
    fsdp = _flag(env, "ACCELERATE_USE_FSDP")
    if deepspeed and fsdp:
        raise PlacementError(
            "both ACCELERATE_USE_DEEPSPEED and ACCELERATE_USE_FSDP are set: a run uses one of them; "
            "unset the other (accelerate config / launch flags)"
        )
    if deepspeed:
        return "deepspeed", "ACCELERATE_USE_DEEPSPEED"
    if fsdp:
        return "fsdp", "ACCELERATE_USE_FSDP"
    # The deepspeed launcher sets CROSS_RANK/CROSS_SIZE/LOCAL_SIZE; torchrun sets LOCAL_WORLD_SIZE.
    if all(k in env for k in ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")):
        return "deepspeed", "deepspeed launcher (CROSS_RANK/CROSS_SIZE/LOCAL_SIZE)"
    if ranks.world_size > 1:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env else "launcher"
        return "ddp", launcher
    return "single", "no launcher"


def _framework_kind() -> tuple[str | None, _Ranks | None, str]:
    """Kind and ranks from frameworks already initialised here; never creates any state."""
    state = _accelerate_state()
    if state is not None:
        dtype = getattr(state.get("distributed_type"), "value", str(state.get("distributed_type")))
        ranks = _Ranks(world_size=int(state.get("num_processes", 1)), rank=int(state.get("process_index", 0)),
                       local_rank=state.get("local_process_index"), local_world_size=None,
                       source=f"accelerate state ({dtype})")
        kind = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp", "NO": "single"}.get(dtype)
        if kind is None:
            kind = "ddp" if ranks.world_size > 1 else "single"
        return kind, ranks, ranks.source
    if _deepspeed_initialised():
        return "deepspeed", _torch_ranks(), "deepspeed initialised"
    ranks = _torch_ranks()
    if ranks is not None and ranks.world_size > 1:
        return "ddp", ranks, ranks.source
    return None, ranks, ""


def _accelerate_state() -> dict[str, Any] | None:
    module = sys.modules.get("accelerate.state")
    if module is None:  # never imported: no state can exist
        return None
    for cls_name in ("AcceleratorState", "PartialState"):
        shared = getattr(getattr(module, cls_name, None), "_shared_state", None)
        if shared and "distributed_type" in shared:
            return dict(shared)
    return None


def _deepspeed_initialised() -> bool:
    comm = getattr(sys.modules.get("deepspeed"), "comm", None)
    if comm is not None and getattr(comm, "is_initialized", lambda: False)():
        return True
    hf_ds = sys.modules.get("transformers.integrations.deepspeed")
    return bool(hf_ds is not None and getattr(hf_ds, "is_deepspeed_zero3_enabled", lambda: False)())


def _torch_ranks() -> _Ranks | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return _Ranks(world_size=dist.get_world_size(), rank=dist.get_rank(), local_rank=None,
                  local_world_size=None, source=f"torch.distributed ({dist.get_backend()})")


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _local_device(local_rank: int, cuda_count: int, env: Mapping[str, str]) -> str:
    if cuda_count <= 0 or _flag(env, "ACCELERATE_USE_CPU"):
        return "cpu"
    # One visible GPU per process (CUDA_VISIBLE_DEVICES set per rank) shows up as cuda:0.
    return f"cuda:{local_rank % cuda_count}"


def detect_context(
    env: Mapping[str, str] | None = None,
    *,
    cuda_device_count: int | None = None,
    frameworks: bool = True,
) -> RuntimeContext:
    """Detect how this process was launched: single process, DDP, DeepSpeed or FSDP.

    Read, in this order (the first that answers wins; a framework that only says "several
    processes" does not override a flag naming DeepSpeed or FSDP):

    1. frameworks already initialised in this process (``frameworks=True``), never creating
       any state: accelerate's ``AcceleratorState``/``PartialState``, an initialised
       ``deepspeed.comm`` or transformers' ZeRO-3 config, an initialised ``torch.distributed``;
    2. accelerate's launch flags ``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_USE_FSDP``;
    3. the deepspeed launcher's ``CROSS_RANK``/``CROSS_SIZE``/``LOCAL_SIZE``;
    4. ``WORLD_SIZE`` > 1 (torchrun, ``torch.distributed.launch``, mpirun's ``OMPI_COMM_WORLD_*``).

    Ranks come from ``RANK``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (``LOCAL_SIZE`` under the deepspeed
    launcher); without a local world size every rank is assumed to share this host.

    Example::

        ctx = detect_context({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
                              "LOCAL_WORLD_SIZE": "2"}, cuda_device_count=2, frameworks=False)
        assert (ctx.kind, ctx.local_device) == ("ddp", "cuda:1")

    Args:
        env: the environment to read; default ``os.environ``.
        cuda_device_count: GPUs this process sees; default asks torch (imported only here).
        frameworks: also inspect initialised frameworks; tests pass ``False`` to read ``env`` only.

    Returns:
        A frozen :class:`RuntimeContext`.

    Raises:
        PlacementError: a rank variable is not an integer, ranks are inconsistent, or both
            DeepSpeed and FSDP are switched on.
    """
    env = os.environ if env is None else env
    ranks = _env_ranks(env)
    kind, source = _env_kind(env, ranks)
    if frameworks:
        fw_kind, fw_ranks, fw_source = _framework_kind()
        # A framework naming DeepSpeed/FSDP wins; one that only knows "several processes" (a
        # PartialState made before the Accelerator, a bare process group) does not override
        # an environment flag that names DeepSpeed/FSDP.
        if fw_kind in _FRAMEWORK_PLACES or (fw_kind == "ddp" and kind == "single"):
            kind, source = fw_kind, fw_source
        if fw_ranks is not None and "WORLD_SIZE" not in env:
            ranks = _merge(fw_ranks, ranks)
    world = ranks.world_size
    local_world = ranks.local_world_size or world
    local_rank = ranks.local_rank if ranks.local_rank is not None else ranks.rank % local_world
    count = _cuda_device_count() if cuda_device_count is None else cuda_device_count
    stage, _ = _int_env(env, "ACCELERATE_DEEPSPEED_ZERO_STAGE")
    return RuntimeContext(kind=kind, world_size=world, rank=ranks.rank, local_rank=local_rank,
                          local_world_size=local_world,
                          local_device=_local_device(local_rank, count, env),
                          zero_stage=stage if kind == "deepspeed" else None,
                          source=ranks.source if source == ranks.source else f"{ranks.source}, {source}")


def _merge(framework: _Ranks, env_ranks: _Ranks) -> _Ranks:
    return _Ranks(world_size=framework.world_size, rank=framework.rank,
                  local_rank=framework.local_rank if framework.local_rank is not None else env_ranks.local_rank,
                  local_world_size=env_ranks.local_world_size, source=framework.source)


def _context(context: RuntimeContext | None) -> RuntimeContext:
    """``context`` or the detected one; a plain single process is recognised without torch."""
    if context is not None:
        return context
    env_ranks = _env_ranks(os.environ)
    quiet = (_env_kind(os.environ, env_ranks)[0] == "single" and "torch" not in sys.modules
             and "accelerate.state" not in sys.modules and "deepspeed" not in sys.modules)
    return RuntimeContext(source="env: no launcher, torch not loaded") if quiet else detect_context()


# ---------------------------------------------------------------------------------------------
# should_place_on_device
# ---------------------------------------------------------------------------------------------
def _device_name(value: Any) -> str:
    """A device as a string: ints and bare ``"cuda"`` become ``"cuda:N"``; others lower-cased."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"cuda:{value}"
    text = str(value).strip().lower()
    try:
        return normalize_device_name(text)
    except ValueError:
        return text  # "mps", "xpu:0", "meta": compared as written


def _accelerators(device_map: Mapping[str, Any]) -> list[str]:
    return sorted({_device_name(v) for v in device_map.values()} - {"cpu", "disk"})


def should_place_on_device(
    model: Any,
    *,
    device: Any,
    deepspeed: bool = False,
    fsdp: bool = False,
    full_eval_half_precision: bool = False,
    training: bool = True,
) -> Decision:
    """Whether a training or evaluation loop should move ``model`` to ``device`` with ``.to()``.

    The rules of transformers' ``Trainer`` (``place_model_on_device``), in its order. Do not move:

    1. a model-parallel model: its ``hf_device_map`` uses more than one device other than cpu
       and disk, or one such device that is not ``device`` (moving would undo the split);
    2. under DeepSpeed, which loads, casts and places the model itself;
    3. under FSDP, which shards the model and moves each shard itself;
    4. for a full fp16/bf16 evaluation without training: cast first, then move, or the fp32
       weights land on the GPU at twice the size.

    Example::

        decision = should_place_on_device(model, device="cuda:0")
        if decision:
            model.to("cuda:0")
        else:
            print(decision.reason)

    Args:
        model: any object; only its ``hf_device_map`` attribute (if any) is read.
        device: the loop's device (``"cuda:0"``, ``0``, ``torch.device``).
        deepspeed: the loop runs under DeepSpeed.
        fsdp: the loop runs under FSDP.
        full_eval_half_precision: evaluation runs fully in fp16/bf16 (``fp16_full_eval``/``bf16_full_eval``).
        training: the run trains (``do_train``); the half-precision rule applies only when it does not.

    Returns:
        A :class:`Decision`, truthy when the model should be moved.
    """
    target = _device_name(device)
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        used = _accelerators(device_map)
        if len(used) > 1 or (len(used) == 1 and used[0] != target):
            return Decision(place=False, rule="model_parallel", reason=(
                f"the model is already split across {', '.join(used)} by its hf_device_map; moving it "
                f"to {target} would undo that placement and may not fit. Leave it where it is, or "
                f"reload it with device_map=None to train it on one device"))
    if deepspeed:
        return Decision(place=False, rule="deepspeed", reason=(
            "DeepSpeed places the model itself (it casts to fp16/bf16 and partitions it when the "
            "engine is created); moving it first wastes GPU memory. Pass the model on the CPU to "
            "deepspeed.initialize / the Trainer"))
    if fsdp:
        return Decision(place=False, rule="fsdp", reason=(
            "FSDP shards the model and moves each shard to its rank's device when it wraps it; "
            "moving the full model first needs the whole model on every GPU. Wrap it on the CPU "
            "(or the meta device) and let FSDP place it"))
    if full_eval_half_precision and not training:
        return Decision(place=False, rule="half_precision_eval", reason=(
            "full fp16/bf16 evaluation without training: cast the model to the half dtype first, "
            "then move it, or its fp32 weights reach the device at twice the size"))
    return Decision(place=True, rule="place", reason=(
        f"nothing else places this model: move it to {target}"))


# ---------------------------------------------------------------------------------------------
# resolve_device_map
# ---------------------------------------------------------------------------------------------
def _map_devices(device_map: Any) -> list[str] | None:
    """Devices a ``device_map`` names, or None for a strategy string."""
    if isinstance(device_map, Mapping):
        return sorted({_device_name(v) for v in device_map.values()})
    if isinstance(device_map, str) and device_map.strip().lower() in STRATEGIES:
        return None
    return [_device_name(device_map)]


def resolve_device_map(device_map: Any, context: RuntimeContext | None = None) -> Any:
    """The ``device_map`` that is valid on this rank (TRL's ``device_map=None`` rule, generalised).

    ``from_pretrained(device_map="auto")`` splits one model over every GPU of one process. In a
    distributed run every rank would do so, over the same GPUs. So, with ``context.kind``:

    * ``"single"``: returned unchanged;
    * ``"ddp"``: a strategy string, or a map that uses a GPU other than the rank's own, becomes
      ``{"": local_device}``: one full replica per rank, as DDP expects; a map on the rank's own
      GPU, CPU or disk is kept;
    * ``"deepspeed"``/``"fsdp"``: anything but a map entirely on the rank's own device becomes
      ``None``: load on the CPU and let the framework place and shard (under ZeRO-3 even the
      rank's own device becomes ``None``: transformers refuses any ``device_map`` there).

    Every change is logged as a warning on the ``placement_opt`` logger, saying why.

    Example::

        model = AutoModelForCausalLM.from_pretrained(name, device_map=resolve_device_map("auto"))

    Args:
        device_map: ``None``, a strategy (``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"``), a device (``"cuda:1"``, ``1``, ``"cpu"``) or a ``{module: device}`` map.
        context: the launch context; default :func:`detect_context`.

    Returns:
        ``device_map`` itself, ``None`` or ``{"": local_device}``.
    """
    if device_map is None:
        return None
    ctx = _context(context)
    if not ctx.is_distributed:
        return device_map
    devices = _map_devices(device_map)
    own = {ctx.local_device, "cpu", "disk"} if ctx.kind == "ddp" else {ctx.local_device}
    zero3 = ctx.kind == "deepspeed" and ctx.zero_stage == 3
    if devices is not None and set(devices) <= own and not zero3:
        return device_map
    if ctx.kind == "ddp":
        replacement: Any = {"": ctx.local_device}
        why = (f"DDP keeps one full replica of the model per rank on its own device; "
               f"using {{'': '{ctx.local_device}'}}")
    else:
        replacement = None
        why = (f"{_LABEL[ctx.kind]} places and shards the model itself "
               f"{'(ZeRO-3 accepts no device_map) ' if zero3 else ''}; using device_map=None "
               f"(load on the CPU, let {_LABEL[ctx.kind]} place it)")
    if devices is None:
        asked = f"device_map={device_map!r} asks to split the model over the devices of one process"
    elif set(devices) <= own:  # ZeRO-3 only
        asked = f"device_map={device_map!r} places the model on this rank's {', '.join(devices)}"
    else:
        asked = f"device_map={device_map!r} puts the model on {', '.join(devices)}, not only on this rank's own device"
    logger.warning("%s: %s, but %s. Pass device_map=%r yourself to silence this warning.",
                   ctx.describe(), asked, why, replacement)
    return replacement


# ---------------------------------------------------------------------------------------------
# local machine
# ---------------------------------------------------------------------------------------------
def _device_names(devices: Any) -> list[str]:
    """Names of the devices in anything :func:`as_machine` accepts, without detecting any."""
    if isinstance(devices, Machine):
        return devices.names
    if isinstance(devices, Device):
        return [devices.name]
    if isinstance(devices, str):
        return [normalize_device_name(item.split("=")[0]) for item in devices.split(",") if item.strip()]
    if isinstance(devices, Mapping):
        return [normalize_device_name(k) for k in devices]
    if isinstance(devices, Iterable):
        return [d.name if isinstance(d, Device) else normalize_device_name(d) for d in devices]
    return [normalize_device_name(devices)]


def check_no_cross_rank_split(devices: Any, context: RuntimeContext) -> None:
    """Raise when a distributed rank is asked to plan over GPUs that are not its own.

    Example::

        ctx = RuntimeContext(kind="ddp", world_size=2, rank=1, local_rank=1, local_world_size=2,
                             local_device="cuda:1")
        check_no_cross_rank_split(["cuda:1", "cpu"], ctx)          # fine
        check_no_cross_rank_split(["cuda:0", "cuda:1", "cpu"], ctx)  # PlacementError

    Args:
        devices: a Machine, Devices, names, a ``max_memory`` dict or a spec string; or a
            :class:`~placement_opt.plan.Plan` (its storage and execution devices), which is
            what ``load(..., plan=plan)`` and ``dispatch(model, plan)`` should check.
        context: the launch context.

    Raises:
        PlacementError: the devices name a GPU other than ``context.local_device``; the message
            names the rank, its device, the GPUs listed and the way out.
    """
    if not context.is_distributed:
        return
    placements = getattr(devices, "placements", None)
    if placements is not None:  # a Plan: the devices it stores on or computes on
        names = sorted({d for p in placements for d in (p.storage, p.execution)})
        noun = "the plan uses"
    else:
        names, noun = _device_names(devices), "the machine lists"
    gpus = [n for n in names if n.startswith("cuda:")]
    foreign = [n for n in gpus if n != context.local_device]
    if not foreign:
        return
    owns = (f"owns {context.local_device}" if context.local_device != "cpu"
            else "runs on the CPU (no GPU of its own)")
    raise PlacementError(
        f"{context.describe()} {owns} but {noun} {', '.join(gpus)}: in a distributed run "
        f"each rank plans for its own device; pass devices for one rank "
        f"(e.g. {_default_devices(context)}) or run a single process"
    )


def _share(device: Device, ranks: int) -> Device:
    """``device`` with 1/``ranks`` of its capacity; a device already shared is left as it is."""
    if ranks <= 1 or _SHARE_TAG in device.source:
        return device
    return replace_device(device, memory_bytes=device.memory_bytes // ranks,
                          reserve_bytes=device.reserve_bytes // ranks,
                          source=f"{device.source}, {_SHARE_TAG} 1/{ranks}")


def local_machine(machine: Machine, context: RuntimeContext) -> Machine:
    """Restrict ``machine`` to what one rank of a distributed run may use.

    Keeps the rank's own GPU (named as it was, ``cuda:<local_rank>``), the CPU and the disk with
    their capacity divided by ``local_world_size`` (the ranks on one host share them), and the
    links between the kept devices. A single process gets ``machine`` unchanged. Idempotent: a
    device already divided carries ``"per-rank share 1/N"`` in its ``source`` and is kept as is,
    so a local machine passed to ``solve()`` is not divided twice.

    Example::

        machine = parse_device_spec("cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=64GiB,disk=1TB")
        local_machine(machine, ctx_rank_1_of_2).names   # ['cuda:1', 'cpu', 'disk'], cpu 32 GiB

    Raises:
        PlacementError: nothing of ``machine`` is left for this rank.
    """
    if not context.is_distributed:
        return machine
    shares = context.local_world_size
    kept = [d if d.is_gpu else _share(d, shares) for d in machine.devices
            if not d.is_gpu or d.name == context.local_device]
    if not kept:
        raise PlacementError(
            f"{context.describe()} owns {context.local_device} but the machine ({', '.join(machine.names)}) "
            f"has neither it nor a CPU or disk: describe this rank's devices, e.g. "
            f"['{context.local_device}', 'cpu', 'disk']"
        )
    names = {d.name for d in kept}
    links = {k: v for k, v in machine.links.items() if k[0] in names and k[1] in names}
    return Machine(kept, links)


def _default_devices(context: RuntimeContext) -> list[str]:
    return ([context.local_device] if context.local_device != "cpu" else []) + ["cpu", "disk"]


def plan_for_context(
    devices: Any = None,
    context: RuntimeContext | None = None,
    *,
    dtype: str = "float16",
) -> tuple[Machine, str | None]:
    """The machine ``solve()``/``load()`` should plan for on this rank, and a note for the plan.

    In a single process this is ``as_machine(devices)`` (or this machine's detected GPU(s), CPU
    and disk when ``devices`` is None) and no note. In a distributed run, devices the user names
    must not include another rank's GPU (:func:`check_no_cross_rank_split`), and the machine is
    restricted to the rank's own GPU plus its share of CPU RAM and disk (:func:`local_machine`);
    without ``devices`` the rank's own device, CPU and disk are detected.

    Example::

        machine, note = plan_for_context(devices)   # inside solve(graph, devices, ...)
        plan = ...solve on machine...; notes += (note,) if note else ()

    Args:
        devices: anything :func:`~placement_opt.devices.as_machine` accepts, or None to detect.
        context: the launch context; default :func:`detect_context` (torch is not imported in a
            plain single process).
        dtype: the model dtype, for detected devices' FLOP/s.

    Returns:
        ``(machine, note)``; ``note`` is None in a single process.

    Raises:
        PlacementError: the user's devices name another rank's GPU.
    """
    ctx = _context(context)
    if not ctx.is_distributed:
        if devices is None:
            devices = _single_default_devices()
        return as_machine(devices, dtype=dtype), None
    if devices is not None:
        check_no_cross_rank_split(devices, ctx)
    machine = local_machine(as_machine(devices if devices is not None else _default_devices(ctx),
                                       dtype=dtype), ctx)
    return machine, _note(machine, ctx)


def _single_default_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(_cuda_device_count())] + ["cpu", "disk"]


def _note(machine: Machine, ctx: RuntimeContext) -> str:
    host = [f"{d.name} {format_bytes(d.memory_bytes)}" for d in machine.devices if not d.is_gpu]
    share = f" (1/{ctx.local_world_size} of this host's)" if ctx.local_world_size > 1 and host else ""
    gpu = next((d.name for d in machine.devices if d.is_gpu), "no GPU")
    placed = (f"; {_LABEL[ctx.kind]} will place and shard the model itself, so this plan sizes one "
              f"full replica" if ctx.framework_places else "")
    return (f"planned for {ctx.describe()} only: {gpu}, {', '.join(host) or 'no host memory'}{share}"
            f"{placed}")
