"""Task logs of a `dag.test()` run, written where Airflow's UI reads them.

`dag.test()` runs every task in this process and writes no task log files, so the UI shows an
empty log for each task of the main job. `TaskLogRecorder` collects the log records of specdec's
code (and Airflow's "[DAG TEST]" lines) per task instance while the run goes, using dag.test()'s
own "starting task_id=... map_index=..." / "end task" lines to know which task is running; then
`write_task_logs` writes them as Airflow 3's JSON log lines to the file each task instance's log
is read from ($AIRFLOW_HOME/logs, Airflow's log filename template), mapped tasks included.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

START = re.compile(r"\[DAG TEST\] starting task_id=(\S+) map_index=(-?\d+)")
END = re.compile(r"\[DAG TEST\] end task task_id=(\S+) map_index=(-?\d+)")
DAG_TEST_LOGGER = "airflow.sdk.definitions.dag"
RECORDED = ("tasks", "specdec_core", DAG_TEST_LOGGER)


class TaskLogRecorder(logging.Handler):
    """Log records (INFO and up) per (task_id, map_index) of the task dag.test() is running."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: dict[tuple[str, int], list[str]] = defaultdict(list)
        self.current: tuple[str, int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            start = START.search(message)
            if start:
                self.current = (start.group(1), int(start.group(2)))
            if self.current is not None:
                line = {"timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
                        "level": record.levelname.lower(), "logger": record.name, "event": message}
                if record.exc_info:
                    line["event"] += "\n" + logging.Formatter().formatException(record.exc_info)
                self.records[self.current].append(json.dumps(line))
            if END.search(message):
                self.current = None
        except Exception:    # a log handler never breaks the run
            self.handleError(record)


@contextmanager
def recording():
    """Record the task logs of a dag.test() run inside the block (yields the recorder)."""
    recorder = TaskLogRecorder()
    saved = {}
    for name in RECORDED:
        logger = logging.getLogger(name)
        saved[name] = logger.level
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(recorder)
    try:
        yield recorder
    finally:
        for name in RECORDED:
            logger = logging.getLogger(name)
            logger.removeHandler(recorder)
            logger.setLevel(saved[name])


def log_path(ti, try_number: int, base_folder: Path) -> Path:
    """The file Airflow's FileTaskHandler reads this task instance's try from."""
    # imported here: Airflow: DAG files' glue: kept light
    from airflow.utils.log.file_task_handler import FileTaskHandler

    return base_folder / FileTaskHandler(str(base_folder))._render_filename(ti, try_number)


def write_task_logs(dag_run, recorder: TaskLogRecorder, base_folder: Path | None = None) -> list[Path]:
    """Write every recorded task instance's lines to its log file; returns the files written."""
    if base_folder is None:
        from airflow.configuration import conf

        base_folder = Path(conf.get("logging", "base_log_folder"))
    written = []
    for ti in dag_run.get_task_instances():
        lines = recorder.records.get((ti.task_id, ti.map_index))
        if not lines:
            continue
        path = log_path(ti, max(ti.try_number, 1), Path(base_folder))
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
        written.append(path)
    return written
