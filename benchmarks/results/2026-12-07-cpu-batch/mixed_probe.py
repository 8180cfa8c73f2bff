"""Exploratory: at N rows, does a layer of misses and SM-only (E-only, compressed) hits cost more than the linear sum of the pure passes?"""
import json, sys, time
import torch
from zipmoe.codecs.reader import ContainerReader
from zipmoe.runtime.plan.layout import container_layout
from zipmoe.runtime.plan import passes as P
from zipmoe.runtime.plan.batched import batch_stream

path, batch = sys.argv[1], int(sys.argv[2])
states = sys.argv[3].split(",")
with ContainerReader(path) as r:
    layout = container_layout(r, "auto", "cpu")
out = {}
with P.runtime_for_passes(path, layout, "cpu", 1, {"readers": 4}) as (model, tok, budget, want):
    rt = model.zipmoe
    cfg = model.config.to_dict()
    prompt, forced = batch_stream(tok, cfg, batch, 4 + 8)
    warm, timed = forced[:4], forced[4:]
    P._run_stream(model, rt, prompt, warm)
    for rep in range(2):
        res = min((P.state_pass(model, rt, "resident", prompt, timed) for _ in range(2)), key=lambda p: p["step_s"])
        row = {"resident": res["step_s"], "experts_per_layer": res["experts_per_layer"]}
        for st in ["none"] + states:
            row[st] = P.state_pass(model, rt, st, prompt, timed)["step_s"]
        for st in states:
            p = P.lone_miss_pass(model, rt, prompt, timed, misses=2, rest=st)
            row[f"mixed_{st}"] = p["step_s"]
            row[f"mixed_{st}_share"] = p.get("rest_share")
            row[f"mixed_{st}_miss_share"] = p.get("miss_share")
        out[rep] = row
        print(json.dumps(row), flush=True)
