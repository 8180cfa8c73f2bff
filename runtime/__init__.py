"""zipmoe.runtime: the serving runtime (``serve``), the planner (``plan``), the benchmark harness
(``bench``) and synthetic checkpoints (``synth``); imports point bench -> plan -> serve."""
