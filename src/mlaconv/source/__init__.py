"""The source checkpoint: what it is and how its tensors are read, whatever its family.

``spec``: ``SourceSpec``, a ``config.json`` validated and normalised (and ``load_source``, which opens one);
``families``: the family table, one registered class per family beside its hooks, and why each refused one is
refused; ``names``: the canonical (Llama) tensor names; ``weights``: ``SourceWeights``, a layer's tensors in that
canonical layout.
"""
