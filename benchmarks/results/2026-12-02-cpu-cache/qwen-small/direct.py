import sys, json, statistics, torch
from zipmoe.runtime.engine.loader import load
from zipmoe.runtime.plan.passes import forced_stream, _run_stream
from zipmoe.machine import torch_threads
budget = sys.argv[1]; plan = sys.argv[2] if len(sys.argv) > 2 else None
model, tok = load("qwen.zmoe", budget=budget, device="cpu", workers=1, threads=torch_threads(1), plan=plan)
rt = model.zipmoe
prompt, forced = forced_stream(tok, model.config.to_dict(), 130, prompt_tokens=32)
times, d = _run_stream(model, rt, prompt, forced[:128])
h = d["hits"]; tot = sum(h.values())
print(budget, "window", rt.window, "median", round(statistics.median(times[8:])*1e3, 2), "mean", round(sum(times[1:])/len(times[1:])*1e3, 2), {k: round(100*v/tot) for k, v in h.items()}, "threads", torch.get_num_threads())
