"""The OpenAI-compatible HTTP server over the serving runtime (``zipmoe serve``): the Starlette app
(:mod:`.app`), request schemas (:mod:`.schemas`), the batching engine (:mod:`.batcher`) on one model
thread, the model seam it steps through (:mod:`.stepper`) and the Prometheus metrics (:mod:`.metrics`).
Depends on ``zipmoe.runtime.engine`` only."""
