"""Round summaries pushed to watchers (the launcher's progress bar, tests): history first, then each new round."""

from __future__ import annotations

import queue
import threading
from typing import Any

from coordinator.dispatch import Finished


class ProgressFeed:
    def __init__(self, lock: threading.Condition) -> None:
        self.lock = lock
        self._watchers: list[queue.Queue[dict[str, Any]]] = []

    def watch(self, history: list[dict[str, Any]], finished: Finished | None) -> queue.Queue[dict[str, Any]]:
        q: queue.Queue[dict[str, Any]] = queue.Queue()
        with self.lock:
            for summary in history:
                q.put(summary)
            if finished is not None:
                q.put(_finished_item(finished))
            self._watchers.append(q)
        return q

    def unwatch(self, q: queue.Queue[dict[str, Any]]) -> None:
        with self.lock:
            if q in self._watchers:
                self._watchers.remove(q)

    def publish(self, summary: dict[str, Any]) -> None:
        with self.lock:
            for q in self._watchers:
                q.put(summary)

    def finish(self, finished: Finished) -> None:
        self.publish(_finished_item(finished))


def _finished_item(finished: Finished) -> dict[str, Any]:
    return {"finished": True, "success": finished.success, "message": finished.reason, "exit_code": finished.exit_code}
