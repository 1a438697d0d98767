"""Per-layer steps on complete statistics: the loop that runs them (loop.py), the steps a run takes
(recipe.py), and one file per method (smoothquant.py, scale_search.py, gptq.py), each method's math beside it
where it is long (smooth.py, gptq_core.py)."""
