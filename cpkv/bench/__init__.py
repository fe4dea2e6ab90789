"""``python -m cpkv.bench``: what the two exchange strategies move, and what planning costs.

Three measurements, all taken in one run and written to ``docs/benchmarks.md`` (plus a
PNG plot): bytes received per rank per layer (:mod:`cpkv.bench.traffic`), planning
time against a per-document Python loop (:mod:`cpkv.bench.planning`), and wall time of
forward + backward on CPU gloo ranks (:mod:`cpkv.bench.walltime`).
"""
