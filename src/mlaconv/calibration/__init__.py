"""Calibration: the source run on real text, one layer at a time.

``windows``: the calibration tokens and their split into fit, select and audit windows; ``streamer``:
``SourceStreamer``, which carries the windows' activations through the source layer by layer and measures each
layer's statistics and attention error; ``rotary_audit``: a layer's rotary figures on the audit windows.
"""
