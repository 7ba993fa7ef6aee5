"""Ahead-of-time compilation of the train step for a cluster, nothing allocated: XLA:CPU on
simulated devices or XLA:GPU for a GPU target without the GPU, and what their programs hold, compute
and communicate (``compile.py``, ``targets.py``, ``hlo_stats.py``, ``overlap.py``, ``report.py``)."""
