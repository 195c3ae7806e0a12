"""The layer graph: the one data structure every later stage reads.

A :class:`LayerGraph` wraps a ``networkx.DiGraph``. Nodes are *placement
units* (the smallest pieces a plan may put on different devices), keyed by
their qualified module name (``"model.layers.0"``). Edges are real data flow
observed in a traced forward.

Node attributes (all present on every node; bytes and FLOPs are ints):

=============================  ==============================================================
``module_class``               class name of the module (``"LlamaDecoderLayer"``)
``exec_index``                 position in the traced forward's execution order (0-based;
                               units never executed come last, in registration order)
``module_index``               position in ``model.named_modules()`` registration order
``param_bytes``                bytes of the parameters the unit owns, in the graph's dtype;
                               a tied parameter is counted once, on the first owner
``buffer_bytes``               bytes of its buffers, persistent and not
``flops_per_token``            FLOPs per token of the traced forward (batch x seq_len tokens)
``attn_flops_per_token_per_ctx``  extra FLOPs per query token for every context token it
                               attends to (0 for units without attention); the context-free
                               part is ``flops_per_token - attn_flops_per_token_per_ctx * seq_len``
``out_bytes_per_token``        bytes of the activation leaving the unit, per token (``"sublayer"``
                               graphs: what its forward returns)
``kv_bytes_per_token``         KV-cache bytes this unit keeps per cached token per sequence
``kv_window_tokens``           optional: the most tokens its cache keeps (a sliding-window layer, as
                               transformers' cache keeps it); absent: every token of the context
``latent_expand_*``            optional, latent attention (DeepSeek's), per cached token per sequence
                               and decode step: ``..._flops_per_ctx`` to expand the cached latents
                               into keys and values, ``..._bytes_per_ctx`` those keys and values
                               alive during attention, ``..._cpu_bytes_per_ctx`` what a CPU's
                               unfused attention holds beside them; absent: no such cache
``moe_num_experts``            number of experts (0 when not MoE)
``moe_experts_per_token``      experts each token is routed to (0 when not MoE)
``moe_expert_bytes``           bytes of all expert weights in the unit (0 when not MoE)
``param_names``                tuple of the qualified parameter names the unit owns
``in_decode``                  bool: the unit runs at every decode step (False for the encoder of
                               an encoder-decoder model, which ``generate()`` runs once)
=============================  ==============================================================

Measured by the meta trace (optional: graphs written before they existed, hand-made and static graphs
lack them, and the cost model then prices the workspace as a multiple of the output):

=========================================  ==================================================
``workspace_bytes_per_token``              the most activation bytes alive while the unit runs,
                                           per token of the forward: its inputs, what earlier
                                           units left alive, its intermediates and outputs
                                           (attention scores apart)
``workspace_bytes_per_token_ctx``          attention-score bytes alive at that moment (scores,
                                           softmax, mask: ``query x key`` shaped), per query
                                           token per context token
``scores_workspace_bytes_per_token``       activation bytes per token alive at the moment the
                                           unit holds the most attention-score bytes (among
                                           equals, a fused attention call)
``scores_workspace_bytes_per_token_ctx``   those score bytes, per query token per context token
=========================================  ==================================================

Measured where a CPU cannot fuse a unit's ``scaled_dot_product_attention`` (query and value heads of different
sizes, latent attention), priced only where the unit computes on a CPU: ``cpu_attention_bytes_per_token`` and
``cpu_attention_bytes_per_token_ctx``, the bytes alive at the peak of its math path, as the two figures above.

Measured by meta decode steps after meta prompts, for units with a KV cache of generating models (the
prefill's queries are its keys, so it cannot tell what a step holds per cached token):
``decode_workspace_bytes`` and ``decode_workspace_bytes_per_ctx``, the bytes alive while the unit runs in a
step, beside the cache, per sequence.

Counted by the trace for units with parameters (absent in graphs written before, hand-made, static and expert
group graphs: the cost model then takes the whole unit): ``largest_module_bytes``, the most parameter bytes one of
the unit's modules holds itself, and ``largest_load_bytes``, the most held while one module is copied out of its
files' maps; what accelerate's hooks, which load each module's own parameters before its forward, hold of an
offloaded unit at once.

Counted by the trace for a unit that computes with parameters another unit stores (a tied LM head):
``tied_param_bytes``, their bytes, which the unit reads at every forward and copies where it streams (absent: 0).

Measured for traced ``"sublayer"`` graphs only (``meta.granularity``), whose units away from the home
device receive their inputs from it: ``in_bytes_per_token``, the bytes per token of the distinct tensors
the unit reads from other units.

Score bytes are charged only where the attention that runs materialises them
(``meta.extra["attn_implementation"]``: eager does, sdpa and flash attention do not); a trace that ran
fused attention (``meta.extra["traced_attention"]``) holds no scores, and its query x context bytes are the
masks the model builds, charged whatever the kernel.

Edge attributes: ``bytes_per_token`` (activation bytes per token crossing the edge).
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx

from .._files import loads_json
from ..errors import PlanFormatError, TraceError
from ..schema import GraphSchema, validated
from ._unit_info import (
    CPU_ATTENTION_NODE_ATTRIBUTES,
    DECODE_NODE_ATTRIBUTES,
    LATENT_NODE_ATTRIBUTES,
    LOAD_NODE_ATTRIBUTES,
    MEASURED_NODE_ATTRIBUTES,
    MODULE_NODE_ATTRIBUTES,
    NODE_ATTRIBUTES,
    OPS_NODE_ATTRIBUTES,
    OPTIONAL_NODE_ATTRIBUTES,
    SUBLAYER_NODE_ATTRIBUTES,
    WINDOW_NODE_ATTRIBUTES,
    UnitInfo,
)

#: What :func:`~.tracer.trace` cuts a model into (torch-free here, for the planner). ``"block"``:
#: no-split blocks are kept whole (default); ``"module"``: every module with its own parameters or
#: buffers is a unit, no-split classes are ignored (finest; a coarser graph is obtained
#: by naming container classes in ``no_split``); ``"sublayer"``: each no-split block is split into its
#: direct children (norms, attention, MLP) and an MoE block further into router, experts and shared
#: expert, for plans that keep the residual stream on one home device (attention on the GPU, experts on
#: the CPU).
GRANULARITIES = ("block", "module", "sublayer")

__all__ = ["LayerGraph", "GraphMeta", "UnitInfo", "GRANULARITIES", "NODE_ATTRIBUTES", "MEASURED_NODE_ATTRIBUTES",
           "SUBLAYER_NODE_ATTRIBUTES", "WINDOW_NODE_ATTRIBUTES", "LATENT_NODE_ATTRIBUTES",
           "CPU_ATTENTION_NODE_ATTRIBUTES", "DECODE_NODE_ATTRIBUTES", "OPS_NODE_ATTRIBUTES",
           "MODULE_NODE_ATTRIBUTES", "LOAD_NODE_ATTRIBUTES", "GRAPH_SCHEMA_VERSION", "chain_graph",
           "covering_key", "keys_below"]

GRAPH_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class GraphMeta:
    """Facts about the whole traced model."""

    model_name: str
    """Model id, config class or module class the graph was built from."""
    dtype: str
    """Torch dtype name of the weights the byte counts assume (``"float16"``)."""
    batch_size: int
    """Batch size of the traced forward."""
    seq_len: int
    """Sequence length of the traced forward."""
    traced: bool
    """True when a meta forward recorded the order and data flow; False for the static fallback."""
    is_encoder_decoder: bool = False
    tied_param_groups: tuple[tuple[str, ...], ...] = ()
    """Groups of parameter names that share one tensor (e.g. ``lm_head.weight`` and ``wte.weight``)."""
    tied_unit_groups: tuple[tuple[str, ...], ...] = ()
    """Groups of unit names that must share a storage device because they hold tied parameters."""
    no_split: tuple[str, ...] = ()
    """Module class names that were kept whole."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Free-form facts (config name, number of layers, ...); JSON-serialisable values only."""

    @property
    def granularity(self) -> str:
        """What a unit is: ``"block"``, ``"module"`` or ``"sublayer"`` (:data:`GRANULARITIES`).

        Kept in ``extra["granularity"]``, where the tracer has always written it, so graphs written before
        it was read keep their meaning; hand-made graphs without it are ``"block"``.
        """
        return str(self.extra.get("granularity", "block"))


class LayerGraph:
    """A directed graph of placement units plus :class:`GraphMeta`.

    ``graph.nx`` is the underlying ``networkx.DiGraph`` for algorithms; everything else
    should use :meth:`units` (execution order) and :meth:`edges`.
    """

    def __init__(self, digraph: nx.DiGraph, meta: GraphMeta) -> None:
        self.nx = digraph
        self.meta = meta
        # name -> (the node's attributes when read, its UnitInfo): a solve reads every unit some 17
        # times, and a frozen 22-field UnitInfo costs 10 us to build (0.1 s on a module-level 70B).
        self._unit_views: dict[str, tuple[dict[str, Any], UnitInfo]] = {}

    # -- reading ----------------------------------------------------------------------
    def __len__(self) -> int:
        return self.nx.number_of_nodes()

    def __contains__(self, name: object) -> bool:
        return name in self.nx

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return (
            f"LayerGraph({self.meta.model_name!r}, units={len(self)}, "
            f"edges={self.nx.number_of_edges()}, param_bytes={self.total_param_bytes})"
        )

    def names(self) -> list[str]:
        """Unit names in execution order."""
        return sorted(self.nx.nodes, key=lambda n: self.nx.nodes[n]["exec_index"])

    def unit(self, name: str) -> UnitInfo:
        attrs = self.nx.nodes[name]
        view = self._unit_views.get(name)
        if view is not None and view[0] == attrs:  # the node is unchanged since (``graph.nx`` is writable)
            return view[1]
        info = UnitInfo(name=name, **attrs)
        self._unit_views[name] = (dict(attrs), info)
        return info

    def units(self) -> list[UnitInfo]:
        """Every unit, in execution order."""
        return [self.unit(n) for n in self.names()]

    def edges(self) -> list[tuple[str, str, int]]:
        """``(src, dst, bytes_per_token)`` for every data-flow edge."""
        return [(u, v, int(d["bytes_per_token"])) for u, v, d in self.nx.edges(data=True)]

    def is_chain(self) -> bool:
        """True when the units form one path in execution order (no branches or skips)."""
        names = self.names()
        expected = set(zip(names, names[1:], strict=False))
        return set(self.nx.edges) <= expected and nx.is_directed_acyclic_graph(self.nx)

    @property
    def total_param_bytes(self) -> int:
        return sum(int(d["param_bytes"]) for _, d in self.nx.nodes(data=True))

    @property
    def total_buffer_bytes(self) -> int:
        return sum(int(d["buffer_bytes"]) for _, d in self.nx.nodes(data=True))

    @property
    def total_flops_per_token(self) -> int:
        return sum(int(d["flops_per_token"]) for _, d in self.nx.nodes(data=True))

    # -- checking and serialising ----------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`TraceError` listing every node or edge that breaks the schema."""
        problems: list[str] = []
        for name, data in self.nx.nodes(data=True):
            missing = sorted(set(NODE_ATTRIBUTES) - set(data))
            extra = sorted(set(data) - set(NODE_ATTRIBUTES) - set(OPTIONAL_NODE_ATTRIBUTES))
            if missing or extra:
                problems.append(f"{name}: missing {missing}, unexpected {extra}")
                continue
            present = {**NODE_ATTRIBUTES, **{k: t for k, t in OPTIONAL_NODE_ATTRIBUTES.items() if k in data}}
            for key, typ in present.items():
                if not isinstance(data[key], typ) or (typ is int and isinstance(data[key], bool)):
                    problems.append(f"{name}.{key} = {data[key]!r} is not {typ.__name__}")
                elif typ is int and data[key] < 0 and key != "exec_index":
                    problems.append(f"{name}.{key} = {data[key]} is negative")
        for u, v, data in self.nx.edges(data=True):
            if not isinstance(data.get("bytes_per_token"), int):
                problems.append(f"edge {u} -> {v} has no integer bytes_per_token")
        if problems:
            raise TraceError("layer graph breaks its schema:\n  " + "\n  ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        meta = asdict(self.meta)
        meta["extra"] = dict(self.meta.extra)
        nodes = [{"name": n, **{k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}}
                 for n, d in ((n, self.nx.nodes[n]) for n in self.names())]
        # in execution order: the same list whatever order the nodes were added in (a graph read back adds
        # them in execution order, the tracer in registration order)
        order = {n: i for i, n in enumerate(self.names())}
        edges = [{"src": u, "dst": v, "bytes_per_token": b}
                 for u, v, b in sorted(self.edges(), key=lambda e: (order[e[0]], order[e[1]]))]
        return {"schema_version": GRAPH_SCHEMA_VERSION, "meta": meta, "nodes": nodes, "edges": edges}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerGraph:
        if not isinstance(data, Mapping):
            raise PlanFormatError(f"a layer graph is a JSON object, not {type(data).__name__}: pass what "
                                  f"LayerGraph.to_dict() or to_json() wrote")
        version = data.get("schema_version")
        if version != GRAPH_SCHEMA_VERSION:
            raise PlanFormatError(
                f"layer graph schema version {version!r} is not supported "
                f"(this placement_opt reads version {GRAPH_SCHEMA_VERSION}): re-trace the model"
            )
        validated(GraphSchema, data, what="the layer graph", fix="write it with LayerGraph.to_json() or re-trace the model")
        meta_d = dict(data["meta"])
        for key in ("tied_param_groups", "tied_unit_groups"):
            meta_d[key] = tuple(tuple(g) for g in meta_d.get(key, ()))
        meta_d["no_split"] = tuple(meta_d.get("no_split", ()))
        digraph = nx.DiGraph()
        for node in data["nodes"]:
            attrs = {k: v for k, v in node.items() if k != "name" and v is not None}  # None: not measured
            attrs["param_names"] = tuple(attrs.get("param_names", ()))
            digraph.add_node(node["name"], **attrs)
        for edge in data["edges"]:
            digraph.add_edge(edge["src"], edge["dst"], bytes_per_token=int(edge["bytes_per_token"]))
        return cls(digraph, GraphMeta(**meta_d))

    @classmethod
    def from_json(cls, text: str) -> LayerGraph:
        """Read what :meth:`to_json` wrote; :class:`PlanFormatError` for text that is not a layer graph."""
        try:
            data = loads_json(text)
        except json.JSONDecodeError as err:
            raise PlanFormatError(f"the layer graph text is not JSON ({err.msg}: line {err.lineno}, column "
                                  f"{err.colno}): give what LayerGraph.to_json() wrote") from err
        return cls.from_dict(data)


def chain_graph(
    units: list[dict[str, Any]],
    *,
    model_name: str = "synthetic",
    dtype: str = "float16",
    edges: list[tuple[str, str, int]] | None = None,
    tied_unit_groups: tuple[tuple[str, ...], ...] = (),
    granularity: str = "block",
) -> LayerGraph:
    """Build a LayerGraph by hand (tests, benchmarks): each dict needs ``name``; missing attributes are 0.

    Without ``edges`` the units are chained in list order with their ``out_bytes_per_token``.
    ``granularity`` is recorded in ``meta.extra`` (``"sublayer"``: priced with a home device).
    """
    digraph = nx.DiGraph()
    for index, spec in enumerate(units):
        defaults = {tuple: (), str: "Module", bool: True, int: 0}
        attrs: dict[str, Any] = {key: defaults[typ] for key, typ in NODE_ATTRIBUTES.items()}
        attrs.update(exec_index=index, module_index=index)
        attrs.update({k: v for k, v in spec.items() if k != "name"})
        attrs["param_names"] = tuple(attrs["param_names"])
        digraph.add_node(spec["name"], **attrs)
    if edges is None:
        names = [u["name"] for u in units]
        edges = [(a, b, int(digraph.nodes[a]["out_bytes_per_token"])) for a, b in zip(names, names[1:], strict=False)]
    for src, dst, nbytes in edges:
        digraph.add_edge(src, dst, bytes_per_token=int(nbytes))
    meta = GraphMeta(model_name=model_name, dtype=dtype, batch_size=1, seq_len=1, traced=False,
                     tied_unit_groups=tied_unit_groups,
                     extra={"granularity": granularity} if granularity != "block" else {})
    return LayerGraph(digraph, meta)


def covering_key(name: str, keys: Container[str]) -> str | None:
    """The longest key of an accelerate-style map that covers module ``name`` (``""`` covers all).

    Walks up the dotted prefixes of ``name`` (``a.b.c``, ``a.b``, ``a``, ``""``): a dict or set
    lookup per level instead of a scan of every key, so resolving a map stays linear in units.
    """
    while True:
        if name in keys:
            return name
        if not name:
            return None
        cut = name.rfind(".")
        name = name[:cut] if cut >= 0 else ""


def keys_below(keys: Iterable[str]) -> dict[str, list[str]]:
    """Module prefix -> the keys strictly inside it (``a.b.c`` is below ``a.b``, ``a`` and ``""``), in order."""
    below: dict[str, list[str]] = {}
    for key in keys:
        parent = key
        while parent:
            cut = parent.rfind(".")
            parent = parent[:cut] if cut >= 0 else ""
            below.setdefault(parent, []).append(key)
    return below
