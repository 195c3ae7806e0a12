"""The JSON schemas of what placement_opt reads back: plans, layer graphs, saved profiles.

Pydantic v2 models check the structure (keys, types, ranges) of a dict read from JSON before
any dataclass is built from it; :func:`validated` turns pydantic's report into one
:class:`~placement_opt.errors.PlanFormatError` saying what is wrong, where, and what to do.
Checks that need vocabulary owned elsewhere (the modes of :mod:`placement_opt.solver.problem`)
read it from the validation context, so each concept keeps its one home.

Example::

    data = validated(PlanSchema, json.loads(text), what="the plan", fix="solve the plan again",
                     context={"modes": ("resident", "stream", "stream_sync", "phased")})
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import PlanFormatError
from .units import few

__all__ = [
    "PlanSchema",
    "PlacementSchema",
    "BaselineSchema",
    "FingerprintSchema",
    "GraphSchema",
    "ProfileSchema",
    "validated",
    "json_kind",
    "json_safe",
    "plan_json_schema",
]

_Model = TypeVar("_Model", bound=BaseModel)


class _Strict(BaseModel):
    """Unknown keys are refused: a typo in a hand-edited file is reported, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _Open(BaseModel):
    """Known keys are checked; other keys (fields added by later minor versions) are kept."""

    model_config = ConfigDict(extra="allow", frozen=True)


# -- plans ------------------------------------------------------------------------------------
class PlacementSchema(_Strict):
    unit: str
    storage: str = Field(min_length=1)
    execution: str = Field(min_length=1)
    mode: str
    prefill_execution: str | None = Field(default=None, min_length=1)
    """``phased`` placements only: the device that computes the unit in the prefill."""
    copy_group: str | None = Field(default=None, min_length=1)
    """Sublayer units only: the block whose streamed units are copied together."""

    @model_validator(mode="after")
    def _phased(self) -> PlacementSchema:
        phased = self.prefill_execution is not None and self.prefill_execution != self.execution
        if phased != (self.mode == "phased"):
            raise ValueError(f"unit {self.unit!r}: a 'phased' placement, and only one, names a prefill_execution "
                             f"other than its execution (mode {self.mode!r}, prefill_execution "
                             f"{self.prefill_execution!r})")
        return self

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str, info: ValidationInfo) -> str:
        modes = (info.context or {}).get("modes")
        if modes is not None and mode not in modes:
            raise ValueError(f"mode {mode!r} is unknown: accepted are {', '.join(modes)}")
        return mode


class BaselineSchema(_Strict):
    strategy: str
    total_s: NonNegativeFloat | None
    """``None`` (JSON null) stands for an infinite time: the baseline could not run."""
    fits: bool
    short_bytes: NonNegativeInt = 0
    note: str = ""


class DeviceSchema(_Open):
    name: str = Field(min_length=1)
    memory_bytes: NonNegativeInt
    reserve_bytes: NonNegativeInt = 0
    flops_per_s: float | None = None
    bandwidth_bytes_per_s: float | None = None


class MachineSchema(_Strict):
    devices: list[DeviceSchema] = Field(min_length=1)
    links: list[tuple[str, str, float]] = []
    profile_path: str | None = Field(default=None, min_length=1)
    """The saved profile whose calibration priced the machine (``--devices PATH``); absent: this host's."""

    @model_validator(mode="after")
    def _unique_names(self) -> MachineSchema:
        names = [d.name for d in self.devices]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"devices {twice} are listed twice")
        return self


class WorkloadSchema(_Strict):
    batch_size: int = Field(ge=1)
    prompt_len: int = Field(ge=1)
    new_tokens: int = Field(ge=0)
    training: bool = False
    optimizer: str = "adam"
    activation_checkpointing: bool = False
    logits: Literal["last", "all"] | None = None
    overlap: bool = False
    padded: bool = False


class UnitCostSchema(_Open):
    """One unit's priced figures: summary() and explain() add them up, so each is checked here (a NaN or a string
    would otherwise reach them as a TypeError, a negative size would be shown). Other keys go to ``UnitCost``."""

    name: str
    storage: str
    execution: str
    mode: str
    prefill_s: NonNegativeFloat
    decode_s: NonNegativeFloat
    stored_bytes: NonNegativeInt
    resident_bytes: NonNegativeInt
    peak_bytes: NonNegativeInt
    prefill_peak_bytes: NonNegativeInt = 0
    copy_prefill_s: NonNegativeFloat = 0.0
    copy_decode_s: NonNegativeFloat = 0.0
    wait_prefill_s: NonNegativeFloat = 0.0
    wait_decode_s: NonNegativeFloat = 0.0
    host_prefill_s: NonNegativeFloat = 0.0
    host_decode_s: NonNegativeFloat = 0.0
    disk_prefill_s: NonNegativeFloat = 0.0
    disk_decode_s: NonNegativeFloat = 0.0


class DeviceMemorySchema(_Open):
    """One device's memory under the plan, the summary's memory table: bytes, never negative."""

    device: str
    capacity_bytes: NonNegativeInt
    reserve_bytes: NonNegativeInt
    weights_bytes: NonNegativeInt
    kv_cache_bytes: NonNegativeInt
    workspace_bytes: NonNegativeInt
    stream_buffer_bytes: NonNegativeInt
    other_bytes: NonNegativeInt = 0


class ViolationSchema(_Open):
    device: str
    needed_bytes: NonNegativeInt
    capacity_bytes: NonNegativeInt
    message: str


class CostSchema(_Open):
    workload: WorkloadSchema
    prefill_s: NonNegativeFloat  # a time: a hand edit to a negative one (or NaN) is refused, not shown
    decode_s: NonNegativeFloat
    transfer_s: NonNegativeFloat
    stage_s: dict[str, NonNegativeFloat]
    units: list[UnitCostSchema]
    memory: list[DeviceMemorySchema]
    violations: list[ViolationSchema]


class UnitFingerprint(_Strict):
    tensors: NonNegativeInt
    """How many parameters the unit owns (tied ones included)."""
    param_bytes: NonNegativeInt
    """Bytes of the parameters it owns first, in the fingerprint's dtype."""
    names: str
    """A digest of the sorted parameter names."""


class FingerprintSchema(_Strict):
    dtype: str
    units: dict[str, UnitFingerprint]
    digest: str


#: The validation context's key holding each plan word's accepted values.
_VOCABULARY = {"objective": "objectives", "strategy": "strategies", "status": "statuses", "dtype": "dtypes"}


class PlanSchema(_Strict):
    schema_version: Literal[1, 2]
    model_name: str
    dtype: str
    objective: str
    strategy: str
    placements: list[PlacementSchema]
    machine: MachineSchema
    workload: WorkloadSchema
    cost: CostSchema
    status: str
    objective_value: float = Field(ge=0)  # seconds or bytes: a NaN or a negative one is a hand edit
    best_bound: float = Field(allow_inf_nan=False)  # not clamped by the solver: a wrong one may show (search.py)
    gap: float = Field(allow_inf_nan=False)
    solve_time_s: float = Field(ge=0)
    baselines: list[BaselineSchema] = []
    notes: list[str] = []
    extra: dict[str, Any] = {}
    fingerprint: FingerprintSchema | None = None
    home: str | None = Field(default=None, min_length=1)
    """Sublayer plans only: the device the residual stream stays on (a GPU or the CPU of the machine)."""

    @field_validator("objective", "strategy", "status", "dtype")
    @classmethod
    def _known_word(cls, word: str, info: ValidationInfo) -> str:
        # the vocabularies live with the solver and the plan; the reader passes them (as it does the modes)
        known = (info.context or {}).get(_VOCABULARY[info.field_name])
        if known is not None and word not in known:
            raise ValueError(f"{info.field_name} {word!r} is unknown: accepted are {', '.join(known)}")
        return word

    @model_validator(mode="after")
    def _consistent(self) -> PlanSchema:
        problems = []
        units = [p.unit for p in self.placements]
        twice = sorted(u for u, n in Counter(units).items() if n > 1)
        if twice:
            problems.append(f"units {_few(twice)} are listed twice in placements")
        devices = {d.name: d for d in self.machine.devices}
        for i, p in enumerate(self.placements):
            if p.storage not in devices:
                problems.append(f"placements[{i}] ({p.unit!r}): storage {p.storage!r} is not a device of the "
                                f"plan's machine (devices: {', '.join(devices)})")
            if p.execution not in devices:
                problems.append(f"placements[{i}] ({p.unit!r}): execution {p.execution!r} is not a device of the "
                                f"plan's machine (devices: {', '.join(devices)})")
            elif p.execution.split(":")[0] == "disk":
                problems.append(f"placements[{i}] ({p.unit!r}): execution {p.execution!r} cannot compute: "
                                f"a unit executes on a GPU or the CPU")
            elif p.storage in devices and (why := _mode_mismatch(p)):
                problems.append(f"placements[{i}] ({p.unit!r}): {why}")
            if p.prefill_execution is not None and (p.prefill_execution not in devices
                                                    or p.prefill_execution.split(":")[0] == "disk"):
                problems.append(f"placements[{i}] ({p.unit!r}): prefill_execution {p.prefill_execution!r} is not "
                                f"a GPU or CPU of the plan's machine (devices: {', '.join(devices)})")
        if self.home is not None and (self.home not in devices or self.home.split(":")[0] == "disk"):
            problems.append(f"home {self.home!r} is not a GPU or CPU of the plan's machine (devices: "
                            f"{', '.join(devices)}): the residual stream stays on a device that computes")
        if self.fingerprint is not None:
            if self.fingerprint.dtype != self.dtype:
                problems.append(f"fingerprint.dtype {self.fingerprint.dtype!r} is not the plan's dtype "
                                f"{self.dtype!r}: both name the dtype the plan was solved for")
            placed = set(units)
            missing = [u for u in self.fingerprint.units if u not in placed]
            unknown = [u for u in units if u not in self.fingerprint.units]
            if missing:
                problems.append(f"placements miss {len(missing)} unit(s) of the model: {_few(missing)}")
            if unknown:
                problems.append(f"placements name {len(unknown)} unit(s) the model does not have: {_few(unknown)}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _mode_mismatch(p: PlacementSchema) -> str | None:
    """Why a placement's mode contradicts its devices (a hand edit), or None."""
    if p.mode == "resident" and p.storage != p.execution:
        return (f"mode 'resident' computes where the weights are stored, but storage is {p.storage!r} and execution "
                f"{p.execution!r}: use mode 'stream' (the weights copied to {p.execution!r} at each forward), or one "
                f"device for both")
    if p.mode in ("stream", "stream_sync") and p.storage == p.execution:
        return f"mode {p.mode!r} copies the weights from storage to execution, but both are {p.storage!r}: use 'resident'"
    return None


# -- layer graphs -----------------------------------------------------------------------------
class NodeSchema(_Strict):
    name: str
    module_class: str
    exec_index: int
    module_index: NonNegativeInt
    param_bytes: NonNegativeInt
    buffer_bytes: NonNegativeInt
    flops_per_token: NonNegativeInt
    attn_flops_per_token_per_ctx: NonNegativeInt
    out_bytes_per_token: NonNegativeInt
    kv_bytes_per_token: NonNegativeInt
    moe_num_experts: NonNegativeInt
    moe_experts_per_token: NonNegativeInt
    moe_expert_bytes: NonNegativeInt
    param_names: list[str]
    in_decode: bool
    workspace_bytes_per_token: NonNegativeInt | None = None
    workspace_bytes_per_token_ctx: NonNegativeInt | None = None
    scores_workspace_bytes_per_token: NonNegativeInt | None = None
    scores_workspace_bytes_per_token_ctx: NonNegativeInt | None = None
    in_bytes_per_token: NonNegativeInt | None = None
    block: str | None = Field(default=None, min_length=1)
    kv_window_tokens: PositiveInt | None = None
    latent_expand_flops_per_ctx: NonNegativeInt | None = None
    latent_expand_bytes_per_ctx: NonNegativeInt | None = None
    latent_expand_cpu_bytes_per_ctx: NonNegativeInt | None = None
    cpu_attention_bytes_per_token: NonNegativeInt | None = None
    cpu_attention_bytes_per_token_ctx: NonNegativeInt | None = None
    decode_workspace_bytes: NonNegativeInt | None = None
    decode_workspace_bytes_per_ctx: NonNegativeInt | None = None
    ops_per_forward: NonNegativeInt | None = None
    layer: str | None = Field(default=None, min_length=1)
    largest_module_bytes: NonNegativeInt | None = None
    largest_load_bytes: NonNegativeInt | None = None
    tied_param_bytes: NonNegativeInt | None = None


class EdgeSchema(_Strict):
    src: str
    dst: str
    bytes_per_token: NonNegativeInt


class GraphMetaSchema(_Strict):
    model_name: str
    dtype: str
    batch_size: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    traced: bool
    is_encoder_decoder: bool = False
    tied_param_groups: list[list[str]] = []
    tied_unit_groups: list[list[str]] = []
    no_split: list[str] = []
    extra: dict[str, Any] = {}


class GraphSchema(_Strict):
    schema_version: Literal[1]
    meta: GraphMetaSchema
    nodes: list[NodeSchema]
    edges: list[EdgeSchema]

    @model_validator(mode="after")
    def _edges_join_nodes(self) -> GraphSchema:
        names = [n.name for n in self.nodes]
        twice = sorted({n for n in names if names.count(n) > 1})
        known = set(names)
        dangling = [f"{e.src} -> {e.dst}" for e in self.edges if e.src not in known or e.dst not in known]
        if twice:
            raise ValueError(f"nodes {_few(twice)} are listed twice")
        if dangling:
            raise ValueError(f"edges {_few(dangling)} name a node that is not in nodes")
        return self


# -- saved profiles ---------------------------------------------------------------------------
class MeasurementSchema(_Open):
    memory_bytes: NonNegativeInt
    matmul_flops_per_s: dict[str, float] = {}
    matvec_bytes_per_s: dict[str, float] = {}
    sequential_read_bytes_per_s: float | None = None
    mapped_read_bytes_per_s: float | None = None
    fresh_page_bytes_per_s: NonNegativeFloat | None = None
    op_overhead_s: NonNegativeFloat | None = None
    staged_to_host_bytes_per_s: NonNegativeFloat | None = None
    fault_latency_s: NonNegativeFloat | None = None
    """Obsolete: a cold page fault with the kernel's read-around, measured by profiles of 2026-11-28 to 11-30, when
    lookup rows faulted in on demand; read by nothing (the runtime now asks for them: ``random_read_*``)."""
    random_read_bytes_per_s: PositiveFloat | None = None
    random_read_latency_s: PositiveFloat | None = None
    to_host_bytes_per_s: NonNegativeFloat | None = None
    """Obsolete: a plain ``.to("cpu")``, measured by profiles of 2026-11-29 only; read by nothing."""
    linear_flops_by_tokens: dict[str, list[tuple[int, float]]] = {}


class ProfileSchema(_Open):
    schema_version: Literal[1]
    created: str
    measurements: dict[str, MeasurementSchema]


# -- helpers ----------------------------------------------------------------------------------
def _few(items: list[str]) -> str:
    return few([repr(i) for i in items])


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _refused_value(error: Mapping[str, Any]) -> str:
    """``", not nan"``: the value a type or range check refused, where pydantic's message does not say it (a NaN
    "should be greater than or equal to 0"). Our own validators' messages name what they refuse already."""
    value = error.get("input")
    if error["type"] == "value_error" or not isinstance(value, (int, float, str)) or len(repr(value)) > 40:
        return ""
    return f", not {value!r}"


def json_kind(value: Any) -> str:
    """What JSON calls ``value``'s kind: ``null``, ``array``, ``string``, ... (not Python's ``NoneType``)."""
    kinds = ((type(None), "null"), (bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def validated(schema: type[_Model], data: Any, *, what: str, fix: str,
              context: Mapping[str, Any] | None = None) -> _Model:
    """``data`` checked against ``schema``, or a :class:`PlanFormatError` naming every problem and its place.

    Args:
        schema: one of the models above.
        data: what ``json.loads`` returned.
        what: the thing read, for the message (``"the plan 'plan.json'"``).
        fix: what the user should do, appended to the message.
        context: vocabulary the validators read (``{"modes": MODES}``).
    """
    if not isinstance(data, Mapping):
        raise PlanFormatError(f"{what} is a JSON {json_kind(data)}, not an object: {fix}")
    try:
        return schema.model_validate(data, context=dict(context or {}))
    except ValidationError as err:
        problems = []
        for e in err.errors(include_url=False):
            msg = e["msg"].removeprefix("Value error, ")
            loc = e["loc"]
            if e["type"] in ("missing", "extra_forbidden"):
                kind = "no" if e["type"] == "missing" else "an unknown"
                where = _where(loc[:-1])
                problems.append(f"{where + ': ' if where else ''}{kind} {loc[-1]!r} field")
            else:
                msg += _refused_value(e)
                problems.append(f"{_where(loc)}: {msg}" if loc else msg)
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise PlanFormatError(f"{what} is malformed ({shown}): {fix}") from None


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float written as a string (``"Infinity"``, ``"-Infinity"``, ``"NaN"``).

    Standard JSON has no infinities; Python's ``json`` would write a bare ``Infinity`` that other
    readers refuse. Pydantic's float fields read these strings back.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of a plan file (for editors and other tools)."""
    return PlanSchema.model_json_schema()
