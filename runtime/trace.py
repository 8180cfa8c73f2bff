"""Activation traces: which experts the router chose, per layer, per token, per forward step.

File format (JSON lines, UTF-8), as in docs/architecture.md:

* first line, the header: ``{"container_id": str, "num_layers": int, "num_experts": int,
  "top_k": int, "layers": [sparse layer numbers], "format": "zipmoe-trace/1"}``
* then one line per forward step (one call of the model: the prefill, then each decoded
  token): ``{"layers": {"<layer>": [[expert ids of token 0], [of token 1], ...]}}``. Tokens are
  the rows the layer saw (batch x sequence, flattened, padding included), expert ids in the
  router's order (top-k order). A SwitchTransformers token dropped by the capacity limit has
  an empty list.

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
        self.steps = 0
        self._f.write(json.dumps({**header, "format": TRACE_FORMAT}) + "\n")

    def record(self, layer, ids: list) -> None:
        key = str(layer)
        with self._lock:
            if key in self._step:  # a layer seen twice without an end-of-step: new step
                self._flush_locked()
            self._step[key] = ids

    def end_step(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._step:
            self._f.write(json.dumps({"layers": self._step}, separators=(",", ":")) + "\n")
            self._f.flush()  # a trace cut short by a crash or Ctrl-C still holds every finished step
            self._step = {}
            self.steps += 1

    def close(self) -> None:
        with self._lock:
            if self._f.closed:
                return
            self._flush_locked()
            self._f.close()


def read_trace(path, container_id: str | None = None) -> tuple[dict, list[dict]]:
    """Read a trace file; with ``container_id``, refuse a trace recorded on another model."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    try:
        header = json.loads(lines[0])
        steps = [json.loads(line)["layers"] for line in lines[1:] if line.strip()]
    except (IndexError, ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is not a zipmoe trace (JSON lines with a header)") from None
    if container_id is not None and header.get("container_id") != container_id:
        raise ModelError(f"trace {path} was recorded on another model (container {header.get('container_id')})")
    return header, steps
