"""Run a plan for real: dispatch (hooks, streams), load from a checkpoint, checkpoint files, disk offload.

``_safetensors_file``, ``_store_files`` <- ``offload`` <- ``checkpoint`` <- ``_streamer`` <- ``_hooks`` <-
``_device_map``, ``_preflight``, ``_undo`` <- ``dispatcher`` <- ``loader``. ``checkpoint`` <- ``pipelining``
(a pipeline plan's stage and schedule on ``torch.distributed.pipelining``).
"""

__all__: list[str] = []
