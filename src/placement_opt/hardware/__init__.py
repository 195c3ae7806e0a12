"""What the machine is: devices and machines (no I/O), detection, profiles, and resolving a user's devices.

``devices`` (pure values) <- ``profile_store`` <- ``detect`` <- ``resolve``; ``profiler`` measures.
"""

__all__: list[str] = []
