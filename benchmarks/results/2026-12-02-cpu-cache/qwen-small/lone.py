import statistics, torch
from zipmoe.runtime.engine.loader import load
from zipmoe.runtime.plan import passes as P
from zipmoe.machine import torch_threads
model, tok = load("qwen.zmoe", budget="400M", device="cpu", workers=1, threads=torch_threads(1))
rt = model.zipmoe
prompt, forced = P.forced_stream(tok, model.config.to_dict(), 25)
P._run_stream(model, rt, prompt, forced[:8])
res = P.state_pass(model, rt, "resident", prompt, forced[8:24])
print("resident", round(res["step_s"]*1e3, 2))
for j in (1, 2, 3, 4):
    r = P.lone_miss_pass(model, rt, prompt, forced[8:16], j)
    print(j, "misses/layer", round(r["step_s"]*1e3, 2), "per layer added", round((r["step_s"]-res["step_s"])/4*1e3, 3), "share", round(r["miss_share"], 2))
n = P.state_pass(model, rt, "none", prompt, forced[8:16])
print("none", round(n["step_s"]*1e3, 2), round((n["step_s"]-res["step_s"])/4*1e3, 3))
