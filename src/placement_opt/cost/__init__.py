"""What a placement costs: pricing, memory, building the solver's problem, device maps, evaluate().

``workload`` <- ``memory`` <- ``kernels`` <- ``context`` <- ``pricing`` <- ``build`` <- ``device_map`` <- ``evaluate``.
"""

__all__: list[str] = []
