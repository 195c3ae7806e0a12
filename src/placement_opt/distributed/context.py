"""The launch context: single process, DDP, DeepSpeed or FSDP, and which device is this rank's own.

A placement that splits one model across devices inside one process is the wrong thing in a
distributed run: DDP, DeepSpeed and FSDP launch one process per GPU and replicate or shard the
model themselves. :func:`detect_context` reads the launch context from the environment and the
frameworks already initialised in this process; :mod:`.rules` says what a training loop should do
with it (following transformers' ``Trainer`` and TRL; ``docs/distributed.md`` gives the reasons),
and :mod:`.ranks` restricts a machine to one rank's share before solving.

Nothing here imports torch at module level; :func:`detect_context` imports it only to count GPUs
(through :func:`placement_opt.hardware.detect.cuda_device_count`), and :func:`current_context`
recognises a plain single process without importing it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PlacementError
from ..hardware import detect

__all__ = ["KINDS", "RuntimeContext", "detect_context", "current_context"]


#: Launch kinds :func:`detect_context` tells apart.
KINDS = ("single", "ddp", "deepspeed", "fsdp")
_TRUE = ("1", "true", "yes", "y", "on", "t")
_FRAMEWORK_PLACES = ("deepspeed", "fsdp")
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

    @property
    def label(self) -> str:
        """The launch kind as people write it: ``"DDP"``, ``"DeepSpeed"``, ``"FSDP"``, ``"single process"``."""
        return _LABEL[self.kind]

    def describe(self) -> str:
        """``"rank 1 of 2 (DDP)"``, or ``"single process"``."""
        if self.kind == "single":
            return "single process"
        return f"rank {self.rank} of {self.world_size} ({self.label})"


# ---------------------------------------------------------------------------------------------
# detect_context
# ---------------------------------------------------------------------------------------------
#: What a launcher writes for an unset switch; anything else that is not in _TRUE is a typo, not "off".
_FALSE = ("", "0", "false", "no", "off", "n", "f")


def _flag(env: Mapping[str, str], key: str) -> bool:
    value = str(env.get(key, "")).strip().lower()
    if value not in _TRUE and value not in _FALSE:  # "enabled" read as off, without a word
        raise PlacementError(f"environment variable {key}={env[key]!r} is neither on nor off: write one of "
                             f"{', '.join(repr(v) for v in _TRUE)} or one of {', '.join(repr(v) for v in _FALSE[1:])}")
    return value in _TRUE


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
    if world is not None and world < 1:
        raise PlacementError(f"environment variable {world_key}={world}: a run has at least one process; the launcher "
                             f"sets it to the number of processes, so unset or fix it")
    if world is not None and world > 1 and rank is None:  # every process would read itself as rank 0
        raise PlacementError(f"environment variable {world_key}={world} names {world} processes but no RANK (or "
                             f"OMPI_COMM_WORLD_RANK, PMI_RANK) says which this one is: every process would plan as "
                             f"rank 0; launch with torchrun/deepspeed/accelerate/mpirun, which set both, or set RANK")
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


def _local_device(local_rank: int, cuda_count: int, env: Mapping[str, str]) -> str:
    if cuda_count <= 0 or _flag(env, "ACCELERATE_USE_CPU"):
        return "cpu"
    # One visible GPU per process (CUDA_VISIBLE_DEVICES set per rank) shows up as cuda:0.
    if cuda_count > 1 and local_rank >= cuda_count:  # a wrap would give this rank another rank's GPU
        raise PlacementError(f"local rank {local_rank} sees {cuda_count} GPUs: cuda:{local_rank % cuda_count} is "
                             f"local rank {local_rank % cuda_count}'s; launch at most {cuda_count} processes per host, "
                             f"or give each process its own GPU (CUDA_VISIBLE_DEVICES per rank)")
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
    count = detect.cuda_device_count() if cuda_device_count is None else cuda_device_count
    stage, _ = _int_env(env, "ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None and kind == "deepspeed" and stage not in (0, 1, 2, 3):
        raise PlacementError(f"environment variable ACCELERATE_DEEPSPEED_ZERO_STAGE={stage}: DeepSpeed's ZeRO "
                             f"stages are 0 to 3; fix the accelerate config")
    return RuntimeContext(kind=kind, world_size=world, rank=ranks.rank, local_rank=local_rank,
                          local_world_size=local_world,
                          local_device=_local_device(local_rank, count, env),
                          zero_stage=stage if kind == "deepspeed" else None,
                          source=ranks.source if source == ranks.source else f"{ranks.source}, {source}")


def _merge(framework: _Ranks, env_ranks: _Ranks) -> _Ranks:
    return _Ranks(world_size=framework.world_size, rank=framework.rank,
                  local_rank=framework.local_rank if framework.local_rank is not None else env_ranks.local_rank,
                  local_world_size=env_ranks.local_world_size, source=framework.source)


def current_context(context: RuntimeContext | None = None) -> RuntimeContext:
    """``context`` or this process's, detected; a plain single process is recognised without torch.

    What ``solve()``, ``load()`` and the training-loop rules call: :func:`detect_context` imports
    torch to count GPUs, this only when a launcher or an imported framework says there may be ranks.
    """
    if context is not None:
        return context
    env_ranks = _env_ranks(os.environ)
    quiet = (_env_kind(os.environ, env_ranks)[0] == "single" and "torch" not in sys.modules
             and "accelerate.state" not in sys.modules and "deepspeed" not in sys.modules)
    return RuntimeContext(source="env: no launcher, torch not loaded") if quiet else detect_context()
