"""Draft shapes: what one speculative step drafts (``draft_shapes``), the cost model predicting each
shape's speed on this machine (``cost_model``), timing shapes in the real loop (``shape_timing``)
and the calibration that measures, predicts, times and picks one (``calibration``)."""
