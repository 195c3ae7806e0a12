"""What a node of the layer graph carries: the attribute tables, with their types, and :class:`UnitInfo`.

The tables name the attributes every node has (:data:`NODE_ATTRIBUTES`) and those a node may have, each
group with its meaning (:mod:`placement_opt.model.graph` describes them all); :class:`UnitInfo` is the typed
read-only view of one node's attributes. Torch-free, like the graph; ``graph.py`` re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UnitInfo", "NODE_ATTRIBUTES", "MEASURED_NODE_ATTRIBUTES", "SUBLAYER_NODE_ATTRIBUTES",
           "WINDOW_NODE_ATTRIBUTES", "LATENT_NODE_ATTRIBUTES", "CPU_ATTENTION_NODE_ATTRIBUTES",
           "DECODE_NODE_ATTRIBUTES", "OPS_NODE_ATTRIBUTES", "MODULE_NODE_ATTRIBUTES", "LOAD_NODE_ATTRIBUTES",
           "TIED_NODE_ATTRIBUTES", "OPTIONAL_NODE_ATTRIBUTES"]

#: Every node carries exactly these attributes, with these types.
NODE_ATTRIBUTES: dict[str, type] = {
    "module_class": str,
    "exec_index": int,
    "module_index": int,
    "param_bytes": int,
    "buffer_bytes": int,
    "flops_per_token": int,
    "attn_flops_per_token_per_ctx": int,
    "out_bytes_per_token": int,
    "kv_bytes_per_token": int,
    "moe_num_experts": int,
    "moe_experts_per_token": int,
    "moe_expert_bytes": int,
    "param_names": tuple,
    "in_decode": bool,
}

#: Attributes a node may carry (measured by the meta trace), with these types; absent means not measured.
MEASURED_NODE_ATTRIBUTES: dict[str, type] = {
    "workspace_bytes_per_token": int,
    "workspace_bytes_per_token_ctx": int,
    "scores_workspace_bytes_per_token": int,
    "scores_workspace_bytes_per_token_ctx": int,
}

#: Attributes a node of a ``"sublayer"`` graph carries (measured by the meta trace), with these types.
SUBLAYER_NODE_ATTRIBUTES: dict[str, type] = {"in_bytes_per_token": int, "block": str}

#: Attributes of a unit whose KV cache holds a window of the context only, with these types.
WINDOW_NODE_ATTRIBUTES: dict[str, type] = {"kv_window_tokens": int}

#: Attributes of a unit whose cache holds compressed latents that each decode step expands again (DeepSeek's
#: multi-head latent attention), per cached token per sequence, in this order: FLOPs of the expansion, bytes
#: of the expanded keys and values alive during the step's attention, and what a CPU holds beside them.
LATENT_NODE_ATTRIBUTES: dict[str, type] = {"latent_expand_flops_per_ctx": int, "latent_expand_bytes_per_ctx": int,
                                           "latent_expand_cpu_bytes_per_ctx": int}

#: Attributes of a unit whose attention a CPU cannot fuse (query and value heads of different sizes: latent
#: attention), measured by the meta trace: the bytes alive at its math path's peak, per token and per query x
#: context token, priced where the unit computes on a CPU.
CPU_ATTENTION_NODE_ATTRIBUTES: dict[str, type] = {"cpu_attention_bytes_per_token": int,
                                                  "cpu_attention_bytes_per_token_ctx": int}

#: Attributes of a unit with a KV cache, measured by meta decode steps (``model/_decode_probe.py``): the bytes a
#: decode step holds while the unit runs, per sequence, at no context and per cached token (the cache's grown
#: copy, keys and values repeated to every head or expanded from latents, eager attention's scores).
DECODE_NODE_ATTRIBUTES: dict[str, type] = {"decode_workspace_bytes": int, "decode_workspace_bytes_per_ctx": int}

#: Attribute of a unit counted by the meta trace: the torch ops one forward dispatches for it (its own, a fused
#: attention call as one, and the glue ops run since the unit before it). The host spends a dispatch and the Python
#: around it on each, whatever its size: what bounds a small model's steps, and a GPU's decode steps.
OPS_NODE_ATTRIBUTES: dict[str, type] = {"ops_per_forward": int}

#: Attribute of a unit of a ``"module"`` graph inside a no-split block: the block (decoder layer) it lies in.
MODULE_NODE_ATTRIBUTES: dict[str, type] = {"layer": str}

#: Attributes of a unit with parameters, from the trace: the most parameter bytes one of its modules holds itself
#: (not its children's), and the most bytes loading one module from disk holds. accelerate's hooks load each
#: module's own parameters before its forward and drop them after it: what an offloaded unit of a ``device_map``
#: holds at once; from disk it copies each parameter out of its file's map, whose pages it holds meanwhile.
LOAD_NODE_ATTRIBUTES: dict[str, type] = {"largest_module_bytes": int, "largest_load_bytes": int}

#: Attribute of a unit that computes with parameters another unit stores (a tied LM head multiplies by the
#: embedding matrix): their bytes. They count once, in the storing unit's ``param_bytes``; this unit reads them
#: at every forward, and copies them where it streams, as if they were its own.
TIED_NODE_ATTRIBUTES: dict[str, type] = {"tied_param_bytes": int}

#: Every attribute a node may carry beside :data:`NODE_ATTRIBUTES`, with its type.
OPTIONAL_NODE_ATTRIBUTES = {**MEASURED_NODE_ATTRIBUTES, **SUBLAYER_NODE_ATTRIBUTES, **WINDOW_NODE_ATTRIBUTES,
                            **LATENT_NODE_ATTRIBUTES, **CPU_ATTENTION_NODE_ATTRIBUTES, **DECODE_NODE_ATTRIBUTES,
                            **OPS_NODE_ATTRIBUTES, **MODULE_NODE_ATTRIBUTES, **LOAD_NODE_ATTRIBUTES,
                            **TIED_NODE_ATTRIBUTES}


@dataclass(frozen=True, kw_only=True)
class UnitInfo:
    """One placement unit, as a typed read-only view of a node's attributes."""

    name: str
    """Qualified module name, a valid key of an accelerate ``device_map``."""
    module_class: str
    exec_index: int
    module_index: int
    param_bytes: int
    buffer_bytes: int
    flops_per_token: int
    attn_flops_per_token_per_ctx: int
    out_bytes_per_token: int
    kv_bytes_per_token: int
    moe_num_experts: int
    moe_experts_per_token: int
    moe_expert_bytes: int
    param_names: tuple[str, ...]
    in_decode: bool
    workspace_bytes_per_token: int | None = None
    """Peak activation bytes alive while the unit runs, per token; None when not measured."""
    workspace_bytes_per_token_ctx: int | None = None
    """Attention-score bytes per query x context token alive at that peak; None when not measured."""
    scores_workspace_bytes_per_token: int | None = None
    """Activation bytes per token alive when the unit holds the most score bytes; None when not measured."""
    scores_workspace_bytes_per_token_ctx: int | None = None
    """The most score bytes alive while the unit runs, per query x context token; None when not measured."""
    in_bytes_per_token: int | None = None
    """Bytes per token of the distinct tensors the unit reads from other units; measured for ``"sublayer"``
    graphs only (None otherwise), whose units away from home receive them."""
    block: str | None = None
    """``"sublayer"`` graphs: the no-split block (decoder layer) the unit was cut from, whose streamed parts
    are copied together (one prefetch per block); None otherwise, or for a unit outside every block."""
    kv_window_tokens: int | None = None
    """The most tokens per sequence the unit's KV cache holds: a sliding-window layer's window, as
    transformers' cache keeps it (None: the whole context)."""
    latent_expand_flops_per_ctx: int | None = None
    """FLOPs a decode step spends per cached token per sequence expanding compressed latents into keys and
    values (multi-head latent attention); None: the cache holds keys and values as they are used."""
    latent_expand_bytes_per_ctx: int | None = None
    """Bytes per cached token per sequence of those expanded keys and values, alive during the step's attention."""
    latent_expand_cpu_bytes_per_ctx: int | None = None
    """Bytes per cached token per sequence a CPU holds beside them (its attention kernel cannot fuse the call)."""
    cpu_attention_bytes_per_token: int | None = None
    """Activation bytes per token alive at the peak of an attention call a CPU cannot fuse (its math path, the
    scores apart); None: the unit's attention fuses on a CPU too."""
    cpu_attention_bytes_per_token_ctx: int | None = None
    """The scores, softmax and mask bytes per query x context token alive then."""
    decode_workspace_bytes: int | None = None
    """Bytes a decode step holds while the unit runs, per sequence, beside the KV cache, at no context (measured
    by meta decode steps); None: not measured, the cost model prices the step from the prefill's figures."""
    decode_workspace_bytes_per_ctx: int | None = None
    """What that grows by per cached token per sequence."""
    ops_per_forward: int | None = None
    """Torch ops one forward dispatches for the unit, the glue before it included (counted by the meta trace);
    None: not counted, the cost model charges a fixed overhead per unit."""
    layer: str | None = None
    """``"module"`` graphs: the no-split block (decoder layer, from ``model._no_split_modules``) the module lies in;
    a GPU's kernels hide the host's time over the layer's modules together, as over a sublayer graph's
    :attr:`block` (``cost.context``). None otherwise, or for a module outside every layer."""
    largest_module_bytes: int | None = None
    """The most parameter bytes one of the unit's modules holds itself: what accelerate's hooks load at once when
    the unit is offloaded (each module's own parameters, before its forward). None: not traced (the whole unit)."""
    largest_load_bytes: int | None = None
    """The most bytes accelerate holds while it loads one of the unit's modules from disk: the copies of the
    module's parameters made so far and the file map of the one it copies, both that parameter's size, at the
    worst moment (the maps are let go once each copy is made). None: not traced."""
    tied_param_bytes: int = 0
    """Bytes of the parameters the unit computes with that another unit stores (:data:`TIED_NODE_ATTRIBUTES`)."""

    @property
    def host_span(self) -> str | None:
        """The units a GPU runs back to back while its host queues them: the block or layer this unit is part of
        (None: the unit alone)."""
        return self.block or self.layer

    def kv_tokens(self, context: int) -> int:
        """Tokens per sequence the unit's KV cache holds at ``context`` tokens."""
        return context if self.kv_window_tokens is None else min(context, self.kv_window_tokens)

    def kv_tokens_held(self, prompt_len: int, context: int) -> int:
        """Tokens per sequence of memory the unit's KV cache takes at its peak, over a run from a prompt of
        ``prompt_len`` tokens to ``context``. A sliding-window layer of transformers' ``DynamicCache`` keeps
        its window as a view of the prompt's keys and values, so the whole prompt stays allocated until the
        first decode step replaces it (checked on transformers 5.24: a 200-token prompt, window 16, holds
        200 tokens' storage after the prefill, 16 after one step)."""
        return max(self.kv_tokens(context), min(prompt_len, context))

    @property
    def weight_bytes(self) -> int:
        """Parameters plus buffers: what must be stored somewhere."""
        return self.param_bytes + self.buffer_bytes

    @property
    def read_bytes(self) -> int:
        """What the unit's forward needs at hand: its own weights and the tied ones another unit stores. What a
        dense forward reads, and what streaming the unit copies."""
        return self.weight_bytes + self.tied_param_bytes

    @property
    def is_moe(self) -> bool:
        return self.moe_num_experts > 0
