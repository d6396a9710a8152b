"""``mlaconv convert``: options, plan, the layer pass and the run.

``options``: every option, declared once, and the recipe files that set them; ``plan``: the options checked against
the source and the shapes chosen; ``pipeline``: the one pass over the source's layers every step plugs into;
``calibrated``: the calibrated steps (the (r, R) search, the variants, the refinement and its budget); ``run``:
``convert`` itself (weights-only or calibrated, then check, heal, evaluate); ``report``: the conversion report.
"""
