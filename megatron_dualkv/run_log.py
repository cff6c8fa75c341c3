"""A training run's curves: TensorBoard scalars and JSONL lines (``tools/plot_run.py`` draws either).

``RunLog(tensorboard_dir, jsonl_path)`` writes one record per step and one per update:

* JSONL: ``{"kind": "step", "step": 3, "loss": ..., ...}`` and ``{"kind": "update", "step": 3,
  "update": 7, "epoch": 2, "mini_batch": 1, ...}`` (``update``: the run's update count, 1-based),
  written anew, or appended to (``append=True``: the launch script's resumed runs continue their file).
* TensorBoard (``torch.utils.tensorboard``, the ``tensorboard`` package): each metric under its tag
  in ``METRICS`` at the step, and the update records' under ``update/<tag>`` at the update count.
  The tags are Megatron-LM's training-loop names where it has one (``learning-rate``,
  ``throughput`` for model TFLOP/s per device, ``iteration-time``, ``mem-max-allocated-bytes``;
  its losses go by name, as ``lm loss``: here ``policy loss``), the RL metrics in the same style.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

# JSONL key -> TensorBoard tag
METRICS: Dict[str, str] = {
    "loss": "policy loss",
    "reward": "reward",
    "margin": "margin",
    "clip_fraction": "clip-fraction",
    "dual_clip_fraction": "dual-clip-fraction",
    "ratio": "ratio",
    "kl": "kl",
    "entropy": "entropy",
    "rollout_mismatch": "rollout-mismatch",
    "lr": "learning-rate",
    "tokens_per_s": "tokens-per-second",
    "tflops": "throughput",
    "mfu": "mfu",
    "rho": "rho",
    "peak_memory_bytes": "mem-max-allocated-bytes",
    "seconds": "iteration-time",
}
UPDATE_PREFIX = "update/"


class RunLog:
    """TensorBoard and/or JSONL logs of a run (either may be None); call it on one rank."""

    def __init__(self, tensorboard_dir: Optional[Path] = None, jsonl_path: Optional[Path] = None, append: bool = False):
        self._writer = None if tensorboard_dir is None else _summary_writer(Path(tensorboard_dir))
        self._jsonl = None
        if jsonl_path is not None:
            Path(jsonl_path).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl_path, "a" if append else "w", encoding="utf-8")

    def step(self, step: int, metrics: Dict[str, Optional[float]]) -> None:
        """The metrics of ``step`` (JSONL keys of ``METRICS``; None: not measured, left out)."""
        self._write({"kind": "step", "step": step}, metrics, step, "")

    def update(self, step: int, update: int, epoch: int, mini_batch: int, metrics: Dict[str, Optional[float]]) -> None:
        """The metrics of one optimizer step: the ``update``-th of the run (1-based), in ``step``."""
        self._write({"kind": "update", "step": step, "update": update, "epoch": epoch, "mini_batch": mini_batch},
                    metrics, update, UPDATE_PREFIX)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()

    def _write(self, record: dict, metrics: Dict[str, Optional[float]], x: int, prefix: str) -> None:
        unknown = sorted(set(metrics) - set(METRICS))
        if unknown:
            raise ValueError(f"RunLog: unknown metrics {unknown}; known: {sorted(METRICS)}")
        measured = {name: float(value) for name, value in metrics.items() if value is not None}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({**record, **measured}) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for name, value in measured.items():
                self._writer.add_scalar(prefix + METRICS[name], value, x)
            self._writer.flush()


def _summary_writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=str(folder))
