"""`zipmoe chat FILE.zmoe`: talk to a model served from its container under a memory budget.

Interactive by default (the model's chat template, multi-turn history, tokens streamed;
``/reset``, ``/stats``, ``/exit``; Ctrl-C stops the current answer and keeps the conversation).
The conversation's KV cache (a static cache of ``--context`` positions, allocated once at load)
is kept across turns: a new turn prefills only the tokens after the longest common prefix of
what the cache holds and the newly rendered conversation; ``/reset`` drops it; a conversation
longer than the cache is one line, not a crash.
``--prompt TEXT`` (repeatable: the turns run in order in one conversation) answers and exits;
with ``--json`` one ``--prompt`` prints one JSON document (``token_ids``, ``text``, ``stats``,
``interrupted``) and several print ``{"turns": [{"token_ids", "text", "stats", "interrupted"}, ...]}``.
The work is done by :func:`zipmoe.runtime.engine.loader.load`,
:class:`zipmoe.runtime.engine.loop.DecodeLoop` and :func:`zipmoe.runtime.engine.turn.chat_turn`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer


def _mb(n) -> str:
    return f"{(n or 0) / 1e6:.1f} MB"


def stats_line(s: dict) -> str:
    parts = []
    if s.get("ttft_s") is not None:
        pre = s.get("prefill_tokens")
        reused = (s.get("prompt_tokens") or 0) - (pre or 0)
        extra = f" ({pre} prompt tokens computed, {reused} from the cache)" if pre is not None and reused > 0 else ""
        parts.append(f"ttft {s['ttft_s']:.2f} s{extra}")
    if s.get("tpot_s") is not None:
        parts.append(f"tpot {s['tpot_s'] * 1000:.0f} ms")
    parts.append(f"{s.get('tokens_per_s', 0.0):.1f} tok/s")
    hits = s.get("hits")
    if hits:
        rate = s.get("hit_rate")
        rate_s = f"{rate * 100:.0f}% full" if rate is not None else "no experts"
        parts.append(f"hits {rate_s} (full {hits['full']}, compressed {hits['compressed']}, sm-only {hits['sm_only']}, "
                     f"e-only {hits['e_only']}, miss {hits['none']})")
        parts.append(f"read {_mb(s.get('bytes_read'))}")
    return " · ".join(parts)


def _describe(model, threads: int) -> str:
    from zipmoe.units import format_size

    rt = model.zipmoe
    d = rt.describe()
    pools = ", ".join(f"{k.replace('_', '-')} {format_size(v)}" for k, v in d["pools"].items() if v)
    where = " (full pool on the GPU, others in host memory)" if d["device"].startswith("cuda") else ""
    return (f"{rt.family.name}: {len(rt.sparse_layers)} sparse layers × {rt.num_experts} experts (top-{rt.top_k}); "
            f"budget {format_size(d['budget'])}{where}: dense {format_size(d['dense_bytes'])}, "
            f"working {format_size(d['working_bytes'])}, pools: {pools or 'none'} ({d['split']} split); "
            f"experts {format_size(d['expert_bytes_full'])} whole ({d['compute_dtype']}) / "
            f"{format_size(d['expert_bytes_stored'])} stored; "
            f"computing in {d['compute_dtype']}; "
            f"{d['workers']} decode workers, {threads} torch threads, {'O_DIRECT' if d['direct_io'] else 'buffered'} reads"
            + (f"\nwarning: {d['plan_note']}" if d.get("plan_note") else ""))


def _cumulative(model) -> str:
    from zipmoe.units import format_size

    rt = model.zipmoe
    c = rt.counters.snapshot()
    t = c["time_s"]
    pools = rt.cache.summary()
    pool_s = ", ".join(f"{k.replace('_', '-')} {v['tensors']} tensors {format_size(v['used'])}/{format_size(v['capacity'])}"
                       for k, v in pools.items())
    h = c["hits"]
    total = sum(h.values()) or 1
    return (f"since load: read {_mb(c['bytes_read'])} in {c['reads']} reads; hits "
            + ", ".join(f"{k} {v} ({v / total:.0%})" for k, v in h.items())
            + f"; stage seconds read {t['read']:.2f}, decode {t['decode']:.2f}, merge {t['merge']:.2f}, "
              f"compute {t['compute']:.2f}, wait {t['wait']:.2f}; peak held {format_size(c['peak_held_bytes'])} "
              f"of {format_size(rt.budget)}{_fallback(rt, c)}{_allocated(rt)}\npools: {pool_s}")


def _allocated(rt) -> str:
    """What the budget counts beside what the allocators really hold (CUDA)."""
    from zipmoe.units import format_size

    m = rt.memory() if hasattr(rt, "memory") else {}
    if "device_allocated" not in m:
        return ""
    ring = m.get("staging_ring_bytes")
    return (f"\nmemory: counted {format_size(m['counted_bytes'])} (allocator rounding included); GPU allocated "
            f"{format_size(m['device_allocated'])}, reserved {format_size(m['device_reserved'])} (KV cache and "
            f"activations included)" + (f"; staging ring {format_size(ring)}"
                                        f"{' pinned' if m.get('staging_pinned') else ' NOT pinned'}" if ring else ""))


def _fallback(rt, c: dict) -> str:
    """Buffered reads are shown, never silent: the page cache may have served them."""
    if not c.get("buffered_reads") and not c.get("direct_fallbacks"):
        return ""
    why = getattr(rt.store, "fallback_reason", None) or "direct_io off"
    return f"; {c.get('buffered_reads', 0)} buffered reads (no O_DIRECT: {why})"


def chat(
    file: Path = typer.Argument(..., help="The .zmoe file."),
    budget: str = typer.Option("8G", "--budget", help="Memory for weights: dense + expert cache + in-flight (e.g. 8G, 512M)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="plan.json from `zipmoe plan` (cache pool sizes)."),
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Longest answer in tokens."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Sampling temperature (default: the model's)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling (default: the model's)."),
    greedy: bool = typer.Option(False, "--greedy", help="Greedy decoding (deterministic)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="Answer this message and exit; repeat for several turns of one conversation."),
    as_json: bool = typer.Option(False, "--json", help="With --prompt: print one JSON document."),
    context: int = typer.Option(4096, "--context", help="KV cache length in tokens (clamped to the model's max_position_embeddings); it comes on top of --budget."),
    trace_out: Optional[Path] = typer.Option(None, "--trace-out", help="Record the experts chosen per layer per token (JSON lines)."),
    workers: int = typer.Option(0, "--workers", help="Decompression threads (default: half the cores)."),
    threads: int = typer.Option(0, "--threads", help="Torch threads (default: the cores the workers leave)."),
    warm: bool = typer.Option(False, "--warm", help="Fill the full-tensor pool before the first answer."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto (config.json's), bfloat16 or float32."),
    kernels: str = typer.Option("exact", "--kernels", metavar="exact|fast", help="exact: bit-identical to transformers' eager experts; fast: its grouped_mm experts (bit-identical to experts_implementation=\"grouped_mm\"; needs every expert in the budget)."),
    attention: str = typer.Option("reproducible", "--attention", metavar="reproducible|pytorch", help="On CUDA: reproducible: attention kernels whose bits do not change from run to run (flash, memory-efficient, math); pytorch: PyTorch's own choice (cuDNN's kernel first on Hopper, not deterministic)."),
    force: bool = typer.Option(False, "--force", help="Load even under a memory limit below what serving needs (it will thrash)."),
) -> None:
    """Chat with a model served from its container, bit-identical to the original."""
    from rich.console import Console

    from zipmoe.errors import UsageError, ZipmoeError
    from zipmoe.runtime.engine.turn import chat_inputs, chat_turn
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.engine.loop import ContextFull, DecodeLoop
    from zipmoe.units import format_size, parse_size

    prompts = list(prompt or [])
    if as_json and not prompts:
        raise UsageError("--json needs --prompt (one turn, one JSON document)")
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if temperature is not None and temperature < 0:
        raise UsageError("--temperature must be 0 or more")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    if context < 2:
        raise UsageError("--context must be at least 2 tokens")
    if workers < 0 or threads < 0:
        raise UsageError("--workers and --threads must be at least 1")
    from zipmoe.runtime.engine.settings import check_attention

    check_attention(attention)  # before anything loads
    budget_bytes = parse_size(budget)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    out = Console(highlight=False, soft_wrap=True)
    quiet = as_json

    if not quiet:
        err.print(f"loading {file} …", style="dim", markup=False)
    from zipmoe_cli.default_plan import keep_usage
    from zipmoe_cli.serving import load_args

    args = load_args(file, budget_bytes=budget_bytes, device=device, plan=plan, workers=workers, threads=threads,
                     dtype=dtype, warm=warm, force=force, attention=attention,
                     say=None if quiet else (lambda line: err.print(line, style="dim", markup=False)))
    threads = args["threads"]
    model, tokenizer = load(file, trace=trace_out, kernels=kernels, **args)
    rt = model.zipmoe
    if tokenizer is None:
        rt.close()
        raise UsageError(f"{file} has no tokenizer files: chat needs one (use zipmoe.load and token ids)")
    loop = None
    try:
        if not getattr(model.config, "is_encoder_decoder", False):
            loop = DecodeLoop(model, context=context, batch=1)
    except BaseException:
        rt.close()
        raise
    if not quiet:
        err.print(_describe(model, threads), style="dim", markup=False)
        if loop is not None:
            err.print(loop.describe_kv(context), style="dim", markup=False, soft_wrap=True)
    base = [{"role": "system", "content": system}] if system else []

    def turn(messages, stream: bool):
        inputs = chat_inputs(tokenizer, messages, rt.device)

        def on_text(t):
            out.print(t, end="", markup=False)

        return chat_turn(model, tokenizer, inputs, max_new_tokens=max_new_tokens, greedy=greedy,
                         temperature=temperature, top_p=top_p, seed=seed, on_text=on_text if stream else None,
                         loop=loop, reuse=loop is not None)

    def note_of(res) -> str:
        if res.interrupted:
            return " (stopped)"
        if res.stats.get("stop") == "context":
            return f" (the KV cache is full at {loop.context} tokens: /reset, or a larger --context)"
        return ""

    try:
        if prompts:
            history = list(base)
            turns = []
            for text in prompts:
                history.append({"role": "user", "content": text})
                res = turn(history, stream=not as_json)
                history.append({"role": "assistant", "content": res.text})
                turns.append({"token_ids": res.token_ids, "text": res.text, "stats": res.stats,
                              "interrupted": res.interrupted})
                if not as_json:
                    out.print()
                    err.print(stats_line(res.stats) + note_of(res), style="dim", markup=False)
                if res.interrupted:
                    break
            if as_json:
                doc = turns[0] if len(prompts) == 1 else {"turns": turns}
                sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            return
        err.print("[dim]/reset clears the conversation, /stats shows counters, /exit quits; "
                  "Ctrl-C stops an answer[/dim]")
        history = list(base)
        while True:
            try:
                line = input(">>> ")
            except (EOFError, KeyboardInterrupt):
                out.print()
                return
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit", "/bye"):
                return
            if text == "/reset":
                history = list(base)
                if loop is not None:
                    loop.reset()
                err.print("[dim]conversation cleared[/dim]")
                continue
            if text == "/stats":
                err.print(_cumulative(model), style="dim", markup=False)
                continue
            if text.startswith("/"):
                err.print("[dim]commands: /reset, /stats, /exit[/dim]")
                continue
            history.append({"role": "user", "content": text})
            try:
                res = turn(history, stream=True)
            except ContextFull as exc:  # the conversation outgrew the KV cache: say so, drop the turn
                err.print(f"zipmoe: {str(exc).splitlines()[0]}", style="red", markup=False, soft_wrap=True)
                history.pop()
                continue
            except ZipmoeError as exc:  # e.g. a corrupted chunk: say it, drop the turn, go on
                out.print()
                err.print(f"zipmoe: error: {str(exc).splitlines()[0]}", style="red", markup=False)
                history.pop()
                continue
            out.print()
            history.append({"role": "assistant", "content": res.text})
            err.print(stats_line(res.stats) + note_of(res), style="dim", markup=False)
    finally:
        keep_usage(rt)
        rt.close()
