import sys, numpy as np, torch
from zipmoe.machine import torch_threads
from zipmoe.runtime.engine.loader import load
from zipmoe.runtime.plan.passes import forced_stream, _run_stream
model, tok = load("/work/main/out/demo.zmoe", budget=int(1.6 * 2**30), device="cpu", workers=1, threads=torch_threads(1))
rt = model.zipmoe
cfg = model.config.to_dict()
for steps in (25, 150, 25, 150):
    prompt, forced = forced_stream(tok, cfg, steps)
    rt.loops.pop("plan-pass", None)
    _run_stream(model, rt, prompt, forced[:8])  # warm
    rt.loops.pop("plan-pass", None)
    times, d = _run_stream(model, rt, prompt, forced)
    print(steps, "context", rt.loops["plan-pass"].context, "median first 24 %.1f ms" % (1e3 * np.median(times[:24])), "median all %.1f" % (1e3 * np.median(times)), d["hits"]["none"])
