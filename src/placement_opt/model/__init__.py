"""What the model is: published configurations, the meta-device tracer, and the LayerGraph it returns.

``catalog`` and ``graph`` import no torch; ``tracer`` (with ``_recorder``) does, so nothing here imports it eagerly.
"""

__all__: list[str] = []
