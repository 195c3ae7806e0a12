"""What the model is: published configurations, the meta-device tracer, and the LayerGraph it returns.

``catalog`` and ``graph`` import no torch; ``tracer`` does, so nothing here imports it eagerly.
``tracer`` runs the steps: ``_source`` (argument -> module on meta), ``_units`` (units, tensors, ties),
``_recorder`` with ``_meta_experts`` (the meta forward), ``_attention`` (heads, ``meta.extra``),
``_node_attributes`` (each unit's node); ``_context`` is what they share; ``dtypes`` parses and reads
dtypes for ``trace`` and ``load``.
"""

__all__: list[str] = []
