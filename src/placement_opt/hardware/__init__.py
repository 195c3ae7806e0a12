"""What the machine is: devices and machines (no I/O), detection, profiles, and resolving a user's devices.

``presets`` (datasheet data) <- ``devices`` (pure values) <- ``profile_store`` <- ``detect`` (the only
code asking torch.cuda, psutil or the file system) <- ``resolve`` (``resolve_machine``: what solve,
load and the CLI call); ``profiler`` measures. ``devices`` <- ``cluster`` (hosts, each a Machine, and the
network between them: what pipeline stages are planned over; pure values and parsing).
"""

__all__: list[str] = []
