"""The copy :func:`~.calibrate.calibrate` runs: the model's config cut to the fewest layers that hold every unit
timed, built on a device without its initialisers, every weight tiled from one seeded random block.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["cut_config", "build", "fill", "FILL_BLOCK_ELEMENTS"]

#: Elements of the random block every weight is filled from (:func:`fill`): 4 MiB in float32.
FILL_BLOCK_ELEMENTS = 2**20 + 7


_LAYER_INDEX = re.compile(r"\.(\d+)$")


def cut_config(config: Any, timed: Iterable[str], *, chain: bool = False) -> Any:
    """The config with the fewest layers that still hold every unit ``timed`` (a block unit, or the block
    a sublayer unit lies in; layer i kept: i + 1), and with ``chain`` two more where the model has them.

    ``chain`` is for timing disk reads: a plan's disk units read side by side, each one's pages faulted
    in while the next one's are read ahead, and a unit read with nothing after it reads faster. One
    layer alone read its cold weights in 20.8 ms per decode step (Mixtral-shaped, hidden 512) and
    83 ms (Llama, hidden 2048), where the layers of an all-disk plan took 25-31 ms and 100-105 ms;
    a copy of two layers read them in 25.0 ms and 93.6 ms. A chain's reads add up to about its bytes over
    the disk's rate plus a start (the first unit waits for its own pages and the next one's), and the mean
    over the copy's units (:func:`._calibrate_disk._shapes`) spreads that start over as many units as the
    copy chains: hidden 512, 8 layers all on disk, a cold decode step took 22 ms in its first layer and
    7.7 ms in each later one (1.2 ms resident); a copy of two layers priced it at 1.19-1.26x measured,
    one of three at 0.94-1.01x (their MLPs alone on disk: 1.14-1.60x, and 0.91-1.04x)."""
    indices = [int(m.group(1)) for name in timed if (m := _LAYER_INDEX.search(name))]
    cut = copy.deepcopy(config)
    layers = getattr(cut, "num_hidden_layers", None)
    if not isinstance(layers, int) or not indices:
        return cut
    keep = min(layers, max(indices) + 1 + 2 * int(chain))
    cut.num_hidden_layers = keep
    if isinstance(getattr(cut, "layer_types", None), list):  # per-layer attention kinds (sliding windows)
        cut.layer_types = cut.layer_types[:keep]
    return cut


def build(config: Any, dtype: str, device: torch.device) -> nn.Module:
    """The model of ``config`` on ``device`` with random weights, built without running its initialisers."""
    import transformers

    auto = (transformers.AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False)
            else transformers.AutoModelForCausalLM)
    with torch.device(device), _no_init():
        try:
            model = auto.from_config(config, dtype=getattr(torch, dtype))
        except ValueError:
            model = transformers.AutoModel.from_config(config, dtype=getattr(torch, dtype))
    if hasattr(model, "tie_weights"):  # skipped with the initialisers: an untied head was not the model planned
        model.tie_weights()
    fill(model)
    return model.eval()


def _no_init() -> Any:
    """transformers' context that skips torch's and its own weight initialisers (a 7B layer's draws took
    ~5 s of a 16 s calibration on 2 cores); a no-op where this transformers has none."""
    import contextlib

    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            module = __import__(where, fromlist=["no_init_weights"])
        except ImportError:  # pragma: no cover - depends on the transformers version
            continue
        if hasattr(module, "no_init_weights"):
            return module.no_init_weights()
    return contextlib.nullcontext()  # pragma: no cover - an old transformers: initialisers run, only slower


def fill(model: nn.Module) -> None:
    """Every floating weight tiled from one seeded random block (N(0, 0.02), as transformers initialises):
    a copy runs at memory speed where drawing runs at a few hundred MB/s. The values matter only for
    being finite and not denormal, as a kernel's time depends on nothing else."""
    block = torch.randn(FILL_BLOCK_ELEMENTS, generator=torch.Generator().manual_seed(0)) * 0.02
    converted: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    with torch.no_grad():
        for tensor in model.parameters():
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if not tensor.is_contiguous():  # pragma: no cover - no transformers weight is strided
                tensor.normal_(0.0, 0.02)
                continue
            source = converted.setdefault((tensor.device, tensor.dtype), block.to(tensor.device, tensor.dtype))
            flat = tensor.view(-1)
            for start in range(0, flat.numel(), source.numel()):
                piece = flat[start:start + source.numel()]
                piece.copy_(source[:piece.numel()])
