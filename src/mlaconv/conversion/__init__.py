"""``mlaconv convert``: options, plan, the layer pass and the run.

``options``: every option, declared once, and the recipe files that set them; ``plan``: the options checked against
the source, the serving target resolved and the shapes chosen; ``pipeline``: the one pass over the source's layers
every step plugs into; ``pipelines``: the conversion pipelines, registered by name; ``weights_only`` and
``calibrated``: those two pipelines (calibrated: the (r, R) search, the variants, the refinement and its budget);
``run``: ``convert`` itself (the pipeline ``choose`` picks, then check, heal, evaluate); ``report``: the conversion
report.
"""
