"""Activation traces: which experts the router chose, per layer, per token, per forward step.

File format (JSON lines, UTF-8), as in docs/architecture.md:

* first line, the header: ``{"container_id": str, "num_layers": int, "num_experts": int,
  "top_k": int, "layers": [sparse layer numbers], "format": "zipmoe-trace/1"}``
* then one line per forward step (one call of the model: the prefill, then each decoded
  token): ``{"layers": {"<layer>": [[expert ids of token 0], [of token 1], ...]}, "input":
  [batch, sequence]}``. Tokens are the rows the layer saw (batch x sequence, flattened, padding
  included), expert ids in the router's order (top-k order). A SwitchTransformers token dropped
  by the capacity limit has an empty list. ``input`` is the shape of the step's input ids
  (``sequence == 1``: a decode step; traces written before 2026-11-30 lack it).

:func:`read_trace` gives back ``(header, steps)``; ``plan`` and ``bench`` use it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from zipmoe.errors import ModelError, UsageError

__all__ = ["TraceWriter", "read_trace", "TRACE_FORMAT"]

TRACE_FORMAT = "zipmoe-trace/1"


class TraceWriter:
    """Collects the router's choices of one forward step and writes them as one line."""

    def __init__(self, path, header: dict) -> None:
        self.path = Path(path)
        try:
            self._f = open(self.path, "w", encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write trace {self.path}: {exc.strerror or exc}") from None
        self._lock = threading.Lock()
        self._step: dict[str, list] = {}
        self._input: list | None = None
        self.steps = 0
        self._f.write(json.dumps({**header, "format": TRACE_FORMAT}) + "\n")

    def record(self, layer, ids: list) -> None:
        key = str(layer)
        with self._lock:
            if key in self._step:  # a layer seen twice without an end-of-step: new step
                self._flush_locked()
            self._step[key] = ids

    def begin_step(self, input_shape) -> None:
        """The shape ``[batch, sequence]`` of the next forward step's input (written with it)."""
        with self._lock:
            self._flush_locked()
            self._input = list(input_shape) if input_shape is not None else None

    def end_step(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._step:
            line = {"layers": self._step}
            if self._input is not None:
                line["input"] = self._input
            self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._f.flush()  # a trace cut short by a crash or Ctrl-C still holds every finished step
            self._step = {}
            self.steps += 1
        self._input = None  # a step that no forward call began (an encoder run alone) has none

    def close(self) -> None:
        with self._lock:
            if self._f.closed:
                return
            self._flush_locked()
            self._f.close()


def read_trace(path, container_id: str | None = None, with_input: bool = False) -> tuple[dict, list]:
    """Read a trace file; with ``container_id``, refuse a trace recorded on another model.

    ``steps`` are the per-step ``{"<layer>": rows}`` dicts, or with ``with_input`` pairs
    ``(layers, [batch, sequence] or None)``."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    try:
        header = json.loads(lines[0])
        parsed = [json.loads(line) for line in lines[1:] if line.strip()]
        steps = [(d["layers"], d.get("input")) if with_input else d["layers"] for d in parsed]
    except (IndexError, ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is not a zipmoe trace (JSON lines with a header)") from None
    if container_id is not None and header.get("container_id") != container_id:
        raise ModelError(f"trace {path} was recorded on another model (container {header.get('container_id')})")
    return header, steps
