"""Memory: what each option holds where, and what each device holds under a placement.

What to say when it is short (one device over capacity: :func:`.shortage.violation`; no placement fits at
all: :func:`.shortage.shortage_message`) is :mod:`.shortage`'s.

Memory per option (priced in :mod:`.pricing`): ``stored_bytes`` on S (parameters and buffers;
training: gradients and optimizer states, which stay where the weights live), ``resident_bytes``
on E (KV cache for ``batch x (prompt + new)`` tokens; training: saved activations), ``peak_bytes``
on E (activation workspace, :func:`workspace_bytes`, plus the stream buffer: x2 for ``stream``, whose
next unit is prefetched). A ``phased`` option (prefill on a GPU P, decode on the CPU E) holds on P, while
its prefill runs, its prefill workspace, a stream buffer and the prompt's KV cache of that unit (moved to E
right after): ``prefill_peak_bytes``, which counts in P's peak like any unit's workspace; its decode workspace
and whole KV cache count on E.

The workspace comes from the model itself: the meta trace measures, per unit, the activation bytes
alive at two moments of its run (everything alive: its inputs, what earlier units left alive, its
intermediates and outputs), split into bytes per token and attention-score bytes per query x context
token: the moment with the most per-token bytes (``UnitInfo.workspace_bytes_per_token``, ``..._ctx``)
and the one with the most score bytes (``scores_workspace_bytes_per_token``, ``..._ctx``). Each is
priced at the workload's shape and the larger counts. A unit's workspace is the larger of its prefill
and decode:

* prefill: ``per_token x batch x prompt + ctx x batch x prompt x prompt``; score bytes only where the
  attention that runs materialises them (eager; not sdpa or flash attention, whose fused kernels keep
  them in on-chip tiles: there, the query x context bytes are the masks the model builds for them, which
  the trace sees as it runs that attention); the logits unit of a ``logits="last"`` workload computes ``batch`` positions
  only; ``generate()`` adds float32 copies of the last logits (:data:`SAMPLING_COPIES`), whatever it keeps;
* decode: for a unit with a KV cache, what meta decode steps measured it holds per sequence
  (``decode_workspace_bytes`` + ``..._per_ctx`` x cached tokens: the cache's grown copy, keys and values
  repeated to every head or expanded from latents, eager attention's scores); plus the mask rows of padded
  prompts and, for MoE units on a GPU, the expert weights transformers' ``batched_mm`` gathers per (token,
  expert) pair (not for expert groups, which keep ``grouped_mm``); on a CPU, latent attention's math-path copies (``latent_expand_cpu_bytes_per_ctx``) and
  scores. Units without those figures: the prefill's figures at ``batch`` tokens over the context, plus one
  unit's KV cache copy (the cache grows by concatenation, so the old and the new tensor of one layer are alive
  at once) and latent attention's expanded keys and values (``latent_expand_bytes_per_ctx``).

Graphs without the measured figures (written before them, static, hand-made) keep the old estimate,
:data:`WORKSPACE_FACTOR` outputs per token.

The CUDA caching allocator, and what it means for these figures (``torch.cuda.max_memory_allocated``
is what they are checked against): every allocation is rounded up to 512 bytes, at most 511 bytes per
live tensor, under 0.01 % of any real model's weights and activations, so it is not charged. Segments
are reserved in 2 MiB steps (20 MiB for small blocks) and the CUDA context takes about 500 MiB on an
H100 with torch 2.x: neither is *allocated* memory; both come out of the reserve
(``Device.reserve_bytes``, :data:`~placement_opt.hardware.devices.DEFAULT_GPU_RESERVE_BYTES`, 1 GiB) that
a GPU whose size was detected or taken from a preset keeps free. A capacity the user gives
(``{0: "10GiB"}``) is, as for accelerate, a budget for the model's tensors: no reserve is taken from it.
What the allocator's default settings can add on top, blocks freed inside segments that still hold live ones
(2.81 GiB beside 6.35 GiB allocated in a 16 x 4096 prefill on an H200), is not charged either: with
``expandable_segments:True``, which the ``placement-opt`` command sets, reserved memory follows allocated memory,
and :func:`~placement_opt.dispatch` warns of a tight plan without it (:mod:`placement_opt.runtime.cuda_allocator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model.expert_groups import whole_experts
from ..solver.problem import GROUP_BUFFERS, Transient
from .workload import Workload, dtype_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Device
    from ..model.graph import GraphMeta, UnitInfo
    from .pricing import OptionPrice

__all__ = ["DeviceMemory", "Violation", "WORKSPACE_FACTOR", "STREAM_BUFFERS", "stream_buffers", "accelerate_held_bytes",
           "SCORE_FREE_ATTENTION", "SAMPLING_COPIES", "CUBLAS_WORKSPACE_BYTES", "CPU_GEMM_WORKSPACE_BYTES",
           "CPU_GEMM_LEAST_BYTES", "CPU_GEMM_BYTES_PER_ROW", "CPU_GEMM_PANEL_ROW_BYTES", "cpu_gemm_scratch",
           "device_memory", "workspace_bytes", "materializes_scores"]

#: Workspace of a unit whose graph has no measured figure, in multiples of its output for all prefill
#: tokens (q/k/v, MLP intermediates and their upcasts live at the same time).
WORKSPACE_FACTOR = 6

#: Attention implementations (transformers' names) whose kernels never hold the ``query x key`` scores
#: in memory: flash and memory-efficient kernels work in tiles. Any other (eager, unknown) is charged them.
SCORE_FREE_ATTENTION = frozenset({"sdpa", "flash_attention_2", "flash_attention_3", "flex_attention",
                                  "paged_attention", "sdpa_paged", "flash_paged"})

#: cuBLAS's workspace, which torch takes from the caching allocator on every GPU that runs a matmul
#: (per handle and stream): 32 MiB on Hopper and later, 4-8 MiB before; the larger is charged.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20

#: The CPU's matmul scratch: MKL's sgemm packs panels of each operand into buffers of its own memory manager
#: (never a live tensor), and keeps them after the call for the next one, so they are the process's from its first
#: matmul on (a warm-up holds them, as it holds the libraries' other state); a later, larger panel than any kept one
#: is allocated beside them. Their size follows the CPU's vector width and the rows multiplied: with AVX2 (torch
#: 2.13 / MKL 2024.2, one thread) 5.0 MiB for a weight of 8192 or more output features, 10.3 MiB kept after 16384 x
#: 256 and then 14336 x 4096; with AVX-512, at 4096 rows, 10.1 MiB after 8192 x 256 and 22.3 MiB after 14336 x 4096
#: (7.1 MiB after 4096 x 4096), and 0.16 MiB at 8 rows (benchmarks/cost_accuracy/mkl_pool.py). The largest of
#: these, charged for one thread: the Device has no thread count, so each further thread's panels are not charged.
#: Charged as the rows multiplied need it, at least the AVX2 figure, at most the unit's weights and its input's
#: panel (:func:`cpu_gemm_scratch`).
CPU_GEMM_WORKSPACE_BYTES = 24 * 2**20
#: The least CPU matmul scratch charged: AVX2's panels for any number of rows (4.1 MiB kept after 8 rows of a 4096 x
#: 256 weight, 5.0 MiB per thread after 14336 x 4096).
CPU_GEMM_LEAST_BYTES = 6 * 2**20
#: Scratch per row multiplied above the least: AVX-512's 22.3 MiB at 4096 rows (0.16 MiB at 8).
CPU_GEMM_BYTES_PER_ROW = 6 * 2**10
#: A small unit's scratch beyond its weights, per row: its input's panel (256 float32 features).
CPU_GEMM_PANEL_ROW_BYTES = 2**10

#: float32 vectors of the vocabulary per sequence that ``generate()`` holds beside the last logits:
#: the float32 copy of the next-token logits and the processed scores / probabilities.
SAMPLING_COPIES = 2
_FLOAT32_BYTES = 4


def materializes_scores(meta: GraphMeta) -> bool:
    """Whether the attention the model runs with holds its ``query x key`` scores in memory."""
    return meta.extra.get("attn_implementation") not in SCORE_FREE_ATTENTION


def _traced_with_scores(meta: GraphMeta) -> bool:
    """Whether the trace's attention held its scores (graphs without the record were traced with eager)."""
    return meta.extra.get("traced_attention", "eager") not in SCORE_FREE_ATTENTION


def workspace_bytes(unit: UnitInfo, workload: Workload, meta: GraphMeta, *, on_gpu: bool = False,
                    phase: str | None = None) -> int:
    """Peak activation bytes on the device that executes ``unit``, in this workload: prefill or decode
    (``phase``: only that one, for a ``phased`` option's two devices), plus the matmul library's
    scratch: :data:`CUBLAS_WORKSPACE_BYTES` ``on_gpu``, else :data:`CPU_GEMM_WORKSPACE_BYTES`. Units
    without measured figures keep the old estimate, :data:`WORKSPACE_FACTOR` outputs per token, alone.

    Example: a decoder layer measured at 60 KiB per token, under sdpa, batch 16 x 1024 prompt tokens:
    60 KiB x 16,384 = 960 MiB in the prefill (decode needs far less), + 32 MiB on a GPU (24 MiB on the CPU at
    that many rows).
    """
    last = workload.logits_kept == "last" and unit.name == meta.extra.get("logits_unit")
    if unit.workspace_bytes_per_token is None:  # not measured: the old multiple of the output
        tokens = workload.batch_size * (1 if last else workload.prompt_len)
        return tokens * unit.out_bytes_per_token * WORKSPACE_FACTOR
    rows = workload.batch_size * (1 if last or phase == "decode" else workload.prompt_len)
    scratch = CUBLAS_WORKSPACE_BYTES if on_gpu else cpu_gemm_scratch(unit, rows)
    return _activation_bytes(unit, workload, meta, last, on_gpu, phase) + scratch


def cpu_gemm_scratch(unit: UnitInfo, rows: int) -> int:
    """MKL's packing buffers for ``unit``'s matmuls of ``rows`` rows (:data:`CPU_GEMM_WORKSPACE_BYTES`): tens of MiB
    at most and, for the tiny units of tests and toy models, no more than the unit's weights and an input panel of
    :data:`CPU_GEMM_PANEL_ROW_BYTES` a row, itself at most the weights (10.1 MiB kept after an 8 MiB weight of 4096
    rows of 256 features, AVX-512; a unit without weights multiplies none)."""
    by_rows = max(CPU_GEMM_LEAST_BYTES, min(CPU_GEMM_WORKSPACE_BYTES, rows * CPU_GEMM_BYTES_PER_ROW))
    return min(by_rows, unit.read_bytes + min(unit.read_bytes, rows * CPU_GEMM_PANEL_ROW_BYTES))


def _activation_bytes(unit: UnitInfo, workload: Workload, meta: GraphMeta, last: bool, on_gpu: bool,
                      phase: str | None = None) -> int:
    assert unit.workspace_bytes_per_token is not None  # checked by the caller
    batch, prompt = workload.batch_size, workload.prompt_len
    moments = _moments(unit, meta, on_gpu)

    def alive(queries: int, context: int, padded: bool = workload.padded) -> int:  # the larger moment at this shape
        # a prompt past the window or padded (a decode step reads the sliding cache unmasked, a padded one a row)
        if queries == context:
            unseen = _unseen_mask(unit, meta, context, padded)
        else:
            unseen = _padded_step_mask(unit, meta) if padded else _UnseenMask()
        # the mask is alive throughout; what attention adds for it, at the score moment (a fused attention call)
        at_attention = (unseen.kernel_copy * queries + unseen.repeated_kv) * batch * context
        peak = max(batch * queries * (linear + scores * context)
                   + (at_attention if k == len(moments) - 1 else 0) for k, (linear, scores) in enumerate(moments))
        mask_rows = batch if unseen.mask_per_sequence else 1
        index = unseen.index_bytes and (_MASK_INDEX_BYTES_GPU if on_gpu else unseen.index_bytes)
        return peak + unseen.mask * mask_rows * queries * context + index * context

    generating = workload.decode_steps > 0
    sampling = _sampling_bytes(unit, batch, meta) if generating and unit.name == meta.extra.get("logits_unit") else 0
    # last logits only: what was alive before the logits unit scales with the prompt, what it adds with the positions
    prefill = (_last_logits_bytes(unit, batch, prompt, meta) if last else alive(prompt, prompt)) + sampling
    if not generating or not unit.in_decode or phase == "prefill":
        return prefill
    context = workload.context_len
    cached = batch * unit.kv_tokens(context)
    cpu_copies = 0 if on_gpu else (unit.latent_expand_cpu_bytes_per_ctx or 0) * cached
    extra = sampling + (_gathered_expert_bytes(unit, batch) if on_gpu else 0) + cpu_copies
    if unit.decode_workspace_bytes_per_ctx is not None:  # measured by meta decode steps: what the step holds
        # the step ran unpadded and fused (the mask rows of padded prompts and a CPU's math-path scores come apart)
        unseen = alive(1, context) - alive(1, context, padded=False)
        scores = 0 if on_gpu else (unit.cpu_attention_bytes_per_token_ctx or 0) * batch * context
        step = batch * (unit.decode_workspace_bytes or 0) + unit.decode_workspace_bytes_per_ctx * cached
        decode = step + unseen + scores + extra
    else:
        expanded = unit.latent_expand_bytes_per_ctx or 0
        decode = alive(1, context) + (unit.kv_bytes_per_token + expanded) * cached + extra
    return decode if phase == "decode" else max(prefill, decode)


def _moments(unit: UnitInfo, meta: GraphMeta, on_gpu: bool) -> list[tuple[int, int]]:
    """``(bytes per token, bytes per query x context token)`` alive at each moment of ``unit``'s run that
    :func:`_activation_bytes` prices (the larger counts), as the attention that runs holds them on this device;
    ``unit`` has measured figures (``workspace_bytes_per_token`` is set)."""
    moments = [(unit.workspace_bytes_per_token, unit.workspace_bytes_per_token_ctx or 0),
               (unit.scores_workspace_bytes_per_token or 0, unit.scores_workspace_bytes_per_token_ctx or 0)]
    # Fused attention holds no scores. A graph traced with it holds only the masks that attention is given
    # (Qwen2-MoE's sliding-window one, batch x prompt^2 bools; Llama's causal mask is skipped), which the run
    # holds too; a graph traced with eager attention but run fused (written before traces ran the attention
    # that runs) cannot tell its masks from its scores, so it drops its query x context terms.
    if not materializes_scores(meta) and _traced_with_scores(meta):
        moments = [(max(linear for linear, _ in moments), 0)]
    elif not on_gpu and unit.cpu_attention_bytes_per_token is not None:  # the call a CPU runs as its math path
        moments.append((unit.cpu_attention_bytes_per_token, unit.cpu_attention_bytes_per_token_ctx or 0))
    return moments


#: Bytes per context position a built mask keeps beside it: int64 query and key positions (measured on a
#: CPU forward of a Mistral past its window: 16 x 2048 bytes at 1 x 2048).
_MASK_INDEX_BYTES = 16
#: The same on a GPU: a padded 1 x 4096 Llama prefill on an H200 (torch 2.11, transformers 5.23) allocated
#: 960 KiB above the CPU-measured prediction, 240 bytes per key position, in two runs
#: (tests/model/test_workspace.py::test_the_masks_sdpa_is_given_are_covered_on_a_gpu): 256 in all, which meets
#: that measurement to the byte. One shape measured, so how it scales is assumed to be the CPU's (per context
#: position, once for the batch); the test now measures a second shape (4 x 2048) before it judges. Charged to a
#: mask built past a sliding window too, which transformers builds the same way (not measured on a GPU).
_MASK_INDEX_BYTES_GPU = 256


@dataclass(frozen=True)
class _UnseenMask:
    """What a mask the trace did not see costs (past a sliding window, padded prompts): ``mask`` bytes per
    query x context token alive through the forward, for each sequence where ``mask_per_sequence`` (padding
    differs between them), else once for the batch, with ``index_bytes`` per context position (the int64
    query and key positions its building keeps); ``kernel_copy`` bytes per such pair per sequence and
    ``repeated_kv`` bytes per context token per sequence alive during the attention call."""

    mask: int = 0
    mask_per_sequence: bool = False
    index_bytes: int = 0
    kernel_copy: int = 0
    repeated_kv: int = 0


def _unseen_mask(unit: UnitInfo, meta: GraphMeta, context: int, padded: bool = False) -> _UnseenMask:
    """The mask fused attention is given, where the trace did not see it: once the context reaches the
    model's sliding window (below it, transformers leaves it to the kernel's causal flag; the trace is
    shorter), or for padded prompts (``Workload.padded``). One bool per query x context token, alive through
    the forward; and, in an attention unit, the copy in the activations' dtype torch makes of it for the
    kernel, and the keys and values repeated to every query head (transformers hands grouped keys and values
    to sdpa as they are only without a mask), both alive during the attention call. The trace's score moment
    is that call where the unit has one (``UnitPeak.score_peak``); in graphs traced before it was, the score
    moment of a unit without score bytes is its linear peak, which they are then charged at too. A prefill's
    only: a decode step attends to the window transformers' sliding cache keeps, unmasked, and a padded
    step's mask is one row (:func:`_padded_step_mask`; measured on the CPU, transformers 5.24)."""
    window = meta.extra.get("sliding_window")
    past_window = isinstance(window, int) and meta.seq_len < window <= context
    if not (past_window or padded) or materializes_scores(meta):
        return _UnseenMask()
    if unit.name == meta.extra.get("logits_unit"):
        return _UnseenMask()  # the model body that held the mask has returned
    if not unit.kv_bytes_per_token:  # no attention of its own: the mask alone
        return _UnseenMask(mask=1, mask_per_sequence=padded, index_bytes=_MASK_INDEX_BYTES)
    copy = min(4, max(2, dtype_bytes(meta.dtype)))  # quantized weights: 16-bit activations
    if not past_window and _saw_handed_mask(unit, meta, copy):
        return _UnseenMask()  # a model that builds its mask padded or not (Falcon): the trace charged it
    heads, kv_heads = meta.extra.get("num_attention_heads"), meta.extra.get("num_key_value_heads")
    grouped = isinstance(heads, int) and isinstance(kv_heads, int) and 0 < kv_heads < heads
    repeated = unit.kv_bytes_per_token * heads // kv_heads if grouped else 0
    return _UnseenMask(mask=1, mask_per_sequence=padded, index_bytes=_MASK_INDEX_BYTES, kernel_copy=copy,
                       repeated_kv=repeated)


def _padded_step_mask(unit: UnitInfo, meta: GraphMeta) -> _UnseenMask:
    """A padded decode step's mask: a bool per sequence and cached position, alive through the forward (the
    query is one token: transformers packs grouped heads into it and repeats no keys; measured on the CPU).
    None where the trace held a query x context term already (a mask it always builds) or scores."""
    if (materializes_scores(meta) or unit.name == meta.extra.get("logits_unit")
            or (not _traced_with_scores(meta) and (unit.workspace_bytes_per_token_ctx or 0) >= 1)):
        return _UnseenMask()
    return _UnseenMask(mask=1, mask_per_sequence=True)


def _saw_handed_mask(unit: UnitInfo, meta: GraphMeta, copy: int) -> bool:
    """Whether the trace (run fused) saw a mask handed to the unit's attention: at its score moment a bool
    and the kernel's copy of it per query x context token (Qwen2-MoE's sliding-window mask, built and never
    handed over, holds the bool alone)."""
    return not _traced_with_scores(meta) and (unit.scores_workspace_bytes_per_token_ctx or 0) >= 1 + copy


def _last_logits_bytes(unit: UnitInfo, batch: int, prompt: int, meta: GraphMeta) -> int:
    """The logits unit's peak when ``generate()`` asks for the last position only: what was alive when it
    started (the hidden states of the whole prompt) plus what it and the glue after it (softcapping) add,
    for one position per sequence. Graphs without the entry figure take the logits alone as what it adds."""
    per_token = unit.workspace_bytes_per_token or 0
    entry = meta.extra.get("logits_entry_bytes_per_token")
    added = per_token - entry if isinstance(entry, int) else min(unit.out_bytes_per_token, per_token)
    return (per_token - added) * batch * prompt + added * batch


def _gathered_expert_bytes(unit: UnitInfo, batch: int) -> int:
    """transformers' ``batched_mm`` experts, which ``generate()`` switches GPU-executed experts to at decode,
    copy the weights of the expert every (token, chosen expert) pair uses: ``batch x top_k`` experts. Expert
    groups keep ``grouped_mm`` (``runtime/_experts.py``) and gather none: charged a share of the layer's gathers,
    a Mixtral-8x7B group of four experts held 5.3 GiB of phantom workspace at batch 16 on a GPU."""
    if not unit.is_moe or whole_experts(unit.name) is not None:
        return 0
    return batch * unit.moe_experts_per_token * unit.moe_expert_bytes // unit.moe_num_experts


def _sampling_bytes(unit: UnitInfo, batch: int, meta: GraphMeta) -> int:
    """``generate()``'s float32 copies of the last logits (:data:`SAMPLING_COPIES` per sequence)."""
    vocab = unit.out_bytes_per_token // dtype_bytes(meta.dtype)
    return SAMPLING_COPIES * batch * vocab * _FLOAT32_BYTES


#: Copies of a unit's weights its stream buffer holds, by mode (``stream`` prefetches the next unit; a
#: ``phased`` unit's prefill is a ``stream``, its decode computes where the weights are stored).
STREAM_BUFFERS = {"resident": 0, "stream": 2, "stream_sync": 1, "phased": 2}


def accelerate_held_bytes(unit: UnitInfo, from_disk_map: bool) -> int:
    """What accelerate's hooks hold of an offloaded unit at once (``stream_sync``): each of its modules' own parameters
    are loaded before that module's forward and dropped after it, so the most of one module
    (:attr:`~...UnitInfo.largest_module_bytes`), with the unit's buffers (kept on the execution device); where the CPU
    reads the unit from disk (``from_disk_map``), the most held while one module is copied out of its files' maps
    (:attr:`~...UnitInfo.largest_load_bytes`). A unit its graph does not describe so: its whole weights.

    A dense decoder layer's largest module is one MLP projection; a fused experts module holds all its experts.
    Measured (``tests/cost/test_cpu_rss.py``, a fresh process, hidden 1024, fp32, each decoder layer on disk): a
    forward's RSS grew 64.3 MiB for a dense layer and 256.1 MiB for a Mixtral-shaped one, predicted now at 1.10x
    and 1.03x of that; a whole layer's weights as the buffer priced them at 1.85x and 0.84x."""
    if unit.largest_module_bytes is None:
        return unit.read_bytes
    held = unit.largest_module_bytes
    if from_disk_map and unit.largest_load_bytes is not None:
        held = max(held, unit.largest_load_bytes)
    return held + unit.buffer_bytes


def stream_buffers(mode: str, on_gpu: bool) -> int:
    """Copies of a unit's weights its stream buffer holds: :data:`STREAM_BUFFERS`, but one for a unit streamed
    to the CPU (from disk: it computes from its memory-mapped pages, and the dispatcher lets the unit before
    it go before it starts; the next unit's read-ahead fills the page cache, not the process)."""
    return STREAM_BUFFERS[mode] if on_gpu or mode != "stream" else 1


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """Memory of one device under a placement, by what it holds."""

    device: str
    capacity_bytes: int
    """Bytes the plan may use: memory less the reserve."""
    reserve_bytes: int
    """Kept free for the CUDA context and allocator slack (not part of ``capacity_bytes``)."""
    weights_bytes: int
    """Parameters and buffers stored here."""
    kv_cache_bytes: int
    """KV cache of the attention units executed here, for batch x (prompt + new tokens)."""
    workspace_bytes: int
    """Peak activation workspace of the units executed here (the largest one, in the prefill)."""
    stream_buffer_bytes: int
    """Buffer that streamed weights pass through (prefetch included), at its peak."""
    other_bytes: int = 0
    """Anything else the memory model charges here (training states)."""
    peak_unit: str = ""
    """The unit executed here whose workspace and stream buffer set the peak ("" when none or not known)."""

    @property
    def used_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes
                + self.stream_buffer_bytes + self.other_bytes)

    @property
    def free_bytes(self) -> int:
        """Negative when the device is over capacity."""
        return self.capacity_bytes - self.used_bytes


@dataclass(frozen=True, kw_only=True)
class Violation:
    """One device over capacity."""

    device: str
    needed_bytes: int
    capacity_bytes: int
    message: str
    """Says what is short, by how much, what takes the space, and what to do."""

    @property
    def short_bytes(self) -> int:
        return self.needed_bytes - self.capacity_bytes


def device_memory(device: Device, chosen: Sequence[OptionPrice], names: Sequence[str] = (),
                  transient: Transient | None = None) -> DeviceMemory:
    """What ``device`` holds when the units take the ``chosen`` options, split by kind.

    ``names``: the units' names, in the order of ``chosen``, to say which unit sets the peak.
    ``transient``: with copy groups, the device's peak as the problem counts it
    (:func:`~..solver.problem.device_transients`): that unit's workspace, and its own buffer plus the groups'
    copies as the stream buffer.
    """
    stored = [p for p in chosen if p.storage == device.name]
    executed_parts = [p for p in chosen if p.execution == device.name]
    # (workspace, stream buffer) each unit computed here adds at its peak; a phased unit adds its prefill's
    # (the prompt's KV cache, held until it moves to the decode device, counted as workspace)
    transients = [(i, p.workspace_bytes, p.stream_buffer_bytes - _group_copies(p, prefill=False))
                  for i, p in enumerate(chosen) if p.execution == device.name]
    transients += [(i, p.prefill_workspace_bytes + p.prefill_kv_bytes,
                    p.prefill_stream_buffer_bytes - _group_copies(p, prefill=True))
                   for i, p in enumerate(chosen) if p.prefill_execution == device.name]
    if transient is None:
        top, workspace, buffer = max(transients, key=lambda t: t[1] + t[2], default=(None, 0, 0))
    else:  # the unit the problem names (its side on this device), and the groups' copies
        top, workspace, buffer = next((t for t in transients if t[0] == transient.unit), (None, 0, 0))
        buffer += transient.run_copies_bytes + transient.next_copies_bytes
    return DeviceMemory(
        device=device.name, capacity_bytes=device.usable_bytes, reserve_bytes=device.reserve_bytes,
        weights_bytes=sum(p.weights_bytes for p in stored),
        kv_cache_bytes=sum(p.kv_cache_bytes for p in executed_parts),
        workspace_bytes=workspace,
        stream_buffer_bytes=buffer,
        other_bytes=sum(p.stored_other_bytes for p in stored) + sum(p.resident_other_bytes for p in executed_parts),
        peak_unit=names[top] if top is not None and top < len(names) else "",
    )


def _group_copies(price: OptionPrice, prefill: bool) -> int:
    """The copies of ``price``'s group share held in its (prefill) stream buffer: a phased option's are in its
    prefill's, a stream's in its own."""
    if not price.group_copy_bytes or (price.prefill_execution is not None) != prefill:
        return 0
    return price.group_copy_bytes * GROUP_BUFFERS
