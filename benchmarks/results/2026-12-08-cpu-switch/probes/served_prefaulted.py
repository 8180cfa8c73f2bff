import json, numpy as np, sys, ctypes, os
import torch
from zipmoe.codecs.reader import ContainerReader
from zipmoe.runtime.plan.layout import container_layout
from zipmoe.runtime.plan import passes as P
from zipmoe.runtime.engine.counters import delta
MODE=sys.argv[1]
if MODE != "plain":
    libc=ctypes.CDLL("libc.so.6")
    print("mallopt", libc.mallopt(-3, 32<<20), libc.mallopt(-1, 1<<40))  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
with ContainerReader(sys.argv[-1] if sys.argv[-1].endswith(".zmoe") else "/tmp/swb/sw.zmoe") as r:
    L=container_layout(r,"auto","cpu")
def show(name, d):
    f=max(1,d["hits"].get("none",0))
    print(name, "fetched", f, {k: round(v/f*1000,2) for k,v in d["time_s"].items() if v}, "ms/tensor")
with P.runtime_for_passes(sys.argv[-1] if sys.argv[-1].endswith(".zmoe") else "/tmp/swb/sw.zmoe", L, "cpu", 1) as (model, tok, budget, want):
    rt=model.zipmoe
    cfg=model.config.to_dict()
    prompt, forced = P.forced_stream(tok, cfg, 64)
    cap=int(float(os.environ.get("SHARE","0.25"))*L.total_expert_full)
    if MODE == "prefault":
        junk=[torch.empty((3072,768),dtype=torch.bfloat16) for _ in range(cap//(3072*768*2))]
        for j in junk: j.view(torch.int16).numpy()[:]=0
        del junk
    b=rt.counters.snapshot()
    served = P.served_pass(model, rt, prompt, forced, cap)
    show("served "+MODE, delta(rt.counters.snapshot(), b))
    print("mean step", served["mean_step_s"])
