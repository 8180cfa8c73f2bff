"""What ``zipmoe chat`` and ``zipmoe serve`` both pass to ``zipmoe.load``, made in one place.

A lone request on the server decodes as a chat turn does: the same decode workers and torch
threads (chat's rule: half the cores decode, torch takes the rest), the same engine settings
from the environment, the same default plan (fitted from the cached profile and the kept
routing, or full tensors only), the same attention kernels. Both commands call
:func:`load_args`, so that the two cannot drift apart (tests/test_serve_chat_parity.py).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["load_args"]


def load_args(file: Path, *, budget_bytes: int, device: str, plan, workers: int = 0, threads: int = 0,
              dtype: str = "auto", warm: bool = False, force: bool = False, attention: str = "reproducible",
              say=None) -> dict:
    """The keyword arguments of ``zipmoe.load(file, **args)`` for a serving command.

    ``workers`` / ``threads``: 0 for the defaults (``zipmoe.machine.decode_workers`` and
    ``torch_threads``). ``plan``: a plan file, or None for the default plan (its line goes to
    ``say``). ``force``: the command's ``--force`` (over ``ZIPMOE_FORCE``)."""
    from zipmoe.machine import decode_workers, torch_threads
    from zipmoe_cli.default_plan import resolve
    from zipmoe_cli.env import load_options

    engine_options = load_options(force)  # ZIPMOE_READERS / _PREFETCH / _FORCE, and --force
    workers = workers or decode_workers()
    threads = threads or torch_threads(workers)
    plan = resolve(file, plan, budget_bytes, device, workers, engine_options, dtype, say=say)
    return dict(budget=budget_bytes, device=device, plan=plan, workers=workers, threads=threads, warm=warm,
                dtype=dtype, attention=attention, **engine_options)
