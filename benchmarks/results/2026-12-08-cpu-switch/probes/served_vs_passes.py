import json, numpy as np, sys
from zipmoe.codecs.reader import ContainerReader
from zipmoe.runtime.plan.layout import container_layout
from zipmoe.runtime.plan import passes as P
from zipmoe.runtime.engine.counters import delta
with ContainerReader(sys.argv[-1] if sys.argv[-1].endswith(".zmoe") else "/tmp/swb/sw.zmoe") as r:
    L=container_layout(r,"auto","cpu")
def show(name, d, n):
    f=max(1,d["hits"].get("none",0))
    print(name, "fetched", f, {k: round(v/f*1000,2) for k,v in d["time_s"].items()}, "ms/tensor; fresh", d.get("fresh_buffers"))
with P.runtime_for_passes(sys.argv[-1] if sys.argv[-1].endswith(".zmoe") else "/tmp/swb/sw.zmoe", L, "cpu", 1) as (model, tok, budget, want):
    rt=model.zipmoe
    cfg=model.config.to_dict()
    prompt, forced = P.forced_stream(tok, cfg, 64)
    P._run_stream(model, rt, prompt, forced[:8])
    b=rt.counters.snapshot()
    lm = P.lone_miss_pass(model, rt, prompt, forced[:8], 1)
    show("lone", delta(rt.counters.snapshot(), b), 0)
    b=rt.counters.snapshot()
    no = P.state_pass(model, rt, "none", prompt, forced[:8])
    show("none", delta(rt.counters.snapshot(), b), 0)
    b=rt.counters.snapshot()
    served = P.served_pass(model, rt, prompt, forced, int(0.25*L.total_expert_full))
    show("served", delta(rt.counters.snapshot(), b), 0)
    print("steps", lm["step_s"], no["step_s"], served["mean_step_s"])
