"""Plans for a batch of rows: each state's cost served at that batch, and the routing as the batch calls the layers.

A plan fitted for one row can lose at four: on the CPU box (2 cores) compressed only, chosen at
batch 1 and 4-8% faster there, ran 4% slower than full tensors only at batch 4 (docs/benchmarks.md
§22r): with four rows a layer calls three to four times the experts, the rows' expert compute
takes the cores the decode workers decompress compressed hits on, and the disk no longer binds.
The batch-1 passes cannot see that, so ``zipmoe plan --batch N`` measures the states again with
``N`` rows (:func:`measure_batch`, kept in the profile under ``batches``) and replays the
calibration's routing as ``N`` rows call the layers (runtime/plan/replay.py ``batched_calls``).

What the batch's costs keep of the batch-1 profile (:func:`step_costs_at`): the misses' scale
fitted to a run at capacity (``served_fit``: misses evicted long before cost more than the
passes' misses read moments before, which holds at any batch). What they drop: the lone-miss curve
and β (``compressed_beside_misses_s``), both measured with one row's ``k`` experts per layer; at
``N`` rows a layer fetches several experts at once and is charged the linear sum of its experts'
costs, which is exact on the layers the passes serve (every expert in one state).
"""

from __future__ import annotations

__all__ = ["batch_stream", "measure_batch", "step_costs_at", "has_batch", "ensure_batch"]


def batch_stream(tok, config: dict, rows: int, steps: int, prompt_tokens: int = 16):
    """``(prompt [rows, p] LongTensor, forced: per step, one token id per row)``: ``rows`` rows of
    the bundled corpus, teacher-forced (runtime/plan/workload.py ``teacher_forced``)."""
    import torch

    from zipmoe.runtime.plan.workload import teacher_forced

    prompts, forced = teacher_forced(tok, config, rows=rows, prompt_tokens=prompt_tokens, new_tokens=steps)
    return torch.tensor(prompts, dtype=torch.long), [[int(f[i]) for f in forced] for i in range(steps)]


def measure_batch(path, layout, batch: int, device: str = "cpu", workers: int = 1, tokens: int = 8,
                  warmup: int = 4, load_options: dict | None = None) -> dict:
    """Serve ``batch`` teacher-forced rows through the runtime once per cache state (the passes of
    runtime/plan/passes.py ``measure_runtime``, at this batch) and turn the step times into
    per-state costs per chosen expert (``state_step_costs`` with the experts a layer call chose
    at this batch, measured). Loads at the budget the batch-1 profile does (every expert whole when
    that fits in a quarter of the free memory)."""
    from zipmoe.runtime.plan.passes import (_run_stream, holds_every_expert, host_state_passes, resident_pass, runtime_for_passes,
                                             state_step_costs)

    batch = int(batch)
    with runtime_for_passes(path, layout, device, workers, load_options) as (model, tok, budget, want):
        rt = model.zipmoe
        cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
        prompt, forced = batch_stream(tok, cfg, batch, warmup + tokens)
        warm, timed = forced[:warmup], forced[warmup:]
        graphs = rt.device.type == "cuda" and rt.slots is not None
        _run_stream(model, rt, prompt, warm)  # every expert the rows use admitted, the graphs captured
        passes: dict = {"resident": resident_pass(model, rt, prompt, timed), "graphs": graphs,
                        **host_state_passes(model, rt, prompt, timed, graphs)}
        per_layer = float(passes["resident"]["experts_per_layer"])
        sc = state_step_costs(passes, per_layer, len(layout.decode_layers))
        return {"batch": batch, "budget": budget, "all_experts_resident": holds_every_expert(model.zipmoe), "tokens": len(timed),
                "experts_per_layer": per_layer, "step_costs": sc,
                "passes": {k: ({kk: vv for kk, vv in v.items() if kk != "step_s_all"} if isinstance(v, dict) else v)
                           for k, v in passes.items()}}


def step_costs_at(profile: dict, batch: int) -> dict | None:
    """The per-state costs a plan for ``batch`` rows is charged with: the profile's own
    (``step_costs``) at batch 1; at more rows the costs served at that batch (``profile["batches"]
    [str(batch)]``, :func:`measure_batch`) with the batch-1 misses' served scale applied, without
    the lone-miss curve and β (the module's docstring says why). None where the profile has no
    costs for that batch."""
    base = (profile or {}).get("step_costs")
    if int(batch) <= 1:
        return base
    got = _batch_entry(profile, batch)
    sc = got.get("step_costs")
    if not sc or not sc.get("resident_step_s"):
        return None
    out = {"resident_step_s": float(sc["resident_step_s"]), "graphs": bool(sc.get("graphs")),
           "per_expert_s": {s: float(v) for s, v in sc["per_expert_s"].items()},
           "measured_share": dict(sc.get("measured_share") or {}), "batch": int(batch),
           "experts_per_layer": float(got.get("experts_per_layer") or 0.0)}
    fit = (base or {}).get("served_fit")
    if fit and "none" in out["per_expert_s"]:
        out["per_expert_s"]["none"] *= float(fit["scale"])
        out["served_scale"] = float(fit["scale"])
    return out


def _batch_entry(profile: dict, batch: int) -> dict:
    """What ``profile`` keeps of ``batch`` rows (``profile["batches"][str(batch)]``), or ``{}``."""
    return ((profile or {}).get("batches") or {}).get(str(int(batch))) or {}


def has_batch(profile: dict, batch: int) -> bool:
    """Whether ``profile`` holds costs served at ``batch`` rows (batch 1: its own)."""
    return int(batch) <= 1 or bool(_batch_entry(profile, batch).get("step_costs"))


def ensure_batch(profile: dict, batch: int, path, layout, *, device: str = "cpu", workers: int = 1,
                 load_options: dict | None = None, save_to=None) -> tuple[dict, bool]:
    """``(profile, measured)``: the profile with its costs served at ``batch`` rows, measured
    (:func:`measure_batch`) and written back to ``save_to`` (the profile's file) when it has none
    yet; a profile measured again starts without them. Batch 1 needs nothing."""
    if has_batch(profile, batch):
        return profile, False
    key = str(int(batch))
    from zipmoe.errors import ServingError

    got = measure_batch(path, layout, int(batch), device=device, workers=workers, load_options=load_options)
    if not got.get("step_costs"):
        raise ServingError(f"the passes at batch {batch} gave no costs (no resident or miss pass)")
    profile = dict(profile, batches=dict(profile.get("batches") or {}, **{key: got}))
    if save_to is not None:
        from zipmoe.runtime.plan.profile import save_profile

        try:
            save_profile(profile, save_to)
        except OSError:
            pass  # a read-only home: plan anyway
    return profile, True
