"""Where the events go: TensorBoard, CSV files, Weights & Biases, Comet — through their own libraries.

An event is DeepSpeed's `(name, value, step)` triple, the step being the global sample count
(e.g. `("Train/Samples/train_loss", 2.31, 640)`). `MonitorMaster` (DeepSpeed's name for
`engine.monitor`) opens the writers the config enables, on rank 0 only, and hands every event to
each of them. TensorBoard and CSV write under `output_path/job_name`.
"""

from __future__ import annotations

import csv
import importlib
import os
from typing import Any, Iterable

Event = tuple[str, float, int]


class MissingPackageError(ImportError):
    """A monitor is enabled in the config but its package is not installed (the message says which)."""


def _require(package: str, key: str, pip_name: str | None = None):
    """Import `package` or fail naming the config key that asked for it and how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise MissingPackageError(
            f"config '{key}.enabled' is true but the '{package}' package is not installed "
            f"({err}); install it (pip install {pip_name or package}) or set "
            f"\"{key}\": {{\"enabled\": false}}") from None


def _log_dir(output_path: str, job_name: str) -> str:
    """`output_path/job_name`, created; an empty output_path is the working directory."""
    path = os.path.join(output_path or os.getcwd(), job_name)
    os.makedirs(path, exist_ok=True)
    return path


class TensorBoardWriter:
    """Scalars into a TensorBoard event file (torch.utils.tensorboard.SummaryWriter)."""

    def __init__(self, output_path: str, job_name: str):
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _log_dir(output_path, job_name)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Iterable[Event]) -> None:
        """Add each event as a scalar, then flush so a running TensorBoard sees it."""
        for name, value, step in events:
            self.summary_writer.add_scalar(name, value, step)
        self.summary_writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.summary_writer.close()


class CsvWriter:
    """One `<name with / as _>.csv` per event under output_path/job_name: a `step,<last part>`
    header, then one row per value (the layout DeepSpeed's csv_monitor writes)."""

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = _log_dir(output_path, job_name)
        self._started: set[str] = set()

    def path(self, name: str) -> str:
        """The CSV file that holds event `name`."""
        return os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, events: Iterable[Event]) -> None:
        """Append each event's row to its file (with a header the first time in this run)."""
        for name, value, step in events:
            path = self.path(name)
            with open(path, "a", newline="", encoding="utf-8") as fh:
                writer = csv.writer(fh)
                if path not in self._started:
                    self._started.add(path)
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        """Nothing stays open between writes."""


class WandbWriter:
    """`wandb.log` of each event at its step, after `wandb.init(project, group, entity=team)`."""

    def __init__(self, project: str, group: str | None, team: str | None):
        self._wandb = _require("wandb", "wandb")
        self.run = self._wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: Iterable[Event]) -> None:
        """Log each event at its step."""
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        """Finish the run."""
        self._wandb.finish()


class CometWriter:
    """Comet metrics through `comet_ml.start(...)`; an event is logged again only after
    `samples_log_interval` more samples (as DeepSpeed's comet monitor does)."""

    def __init__(self, cfg: Any):
        comet_ml = _require("comet_ml", "comet", "comet_ml>=3.41.0")
        self.experiment = comet_ml.start(api_key=cfg.api_key, project=cfg.project,
                                         workspace=cfg.workspace, experiment_key=cfg.experiment_key,
                                         mode=cfg.mode, online=cfg.online)
        if cfg.experiment_name is not None:
            self.experiment.set_name(cfg.experiment_name)
        self.interval = cfg.samples_log_interval
        self._last: dict[str, int] = {}

    def write_events(self, events: Iterable[Event]) -> None:
        """Log each event unless the same name was logged fewer than `interval` samples ago."""
        for name, value, step in events:
            last = self._last.get(name)
            if last is None or step - last >= self.interval:
                self._last[name] = step
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        """End the experiment."""
        self.experiment.end()


class MonitorMaster:
    """`engine.monitor`: every enabled writer, on rank 0 (other ranks hold none and write nothing).

    `enabled` is true when the config enables any monitor, on every rank, as in DeepSpeed.
    """

    def __init__(self, cfg: Any, rank: int | None = None):
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.enabled = any(section.enabled for section in
                           (cfg.tensorboard, cfg.csv_monitor, cfg.wandb, cfg.comet))
        self.writers: list = []
        if rank != 0:
            return
        if cfg.tensorboard.enabled:
            self.writers.append(TensorBoardWriter(cfg.tensorboard.output_path,
                                                  cfg.tensorboard.job_name))
        if cfg.csv_monitor.enabled:
            self.writers.append(CsvWriter(cfg.csv_monitor.output_path, cfg.csv_monitor.job_name))
        if cfg.wandb.enabled:
            self.writers.append(WandbWriter(cfg.wandb.project, cfg.wandb.group, cfg.wandb.team))
        if cfg.comet.enabled:
            self.writers.append(CometWriter(cfg.comet))

    def write_events(self, events: list[Event]) -> None:
        """Give `events` (a list of `(name, value, step)`) to every writer of this rank."""
        events = [(name, float(value), int(step)) for name, value, step in events]
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        """Close every writer (files flushed, runs finished)."""
        for writer in self.writers:
            writer.close()
        self.writers = []
