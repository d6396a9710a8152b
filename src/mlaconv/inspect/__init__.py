"""``mlaconv inspect spectra``: the per-layer spectra and shapes before converting (``spectra``), the refinement it
can start on one layer (``refine``) and the plot (``plot``)."""
