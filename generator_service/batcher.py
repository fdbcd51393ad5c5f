"""Dynamic batching: images of concurrent requests share sampling batches; cancelled requests leave the queue."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from generator_service.backends import PartlyUnservable, Unservable
from generator_service.ddpm.sampling import ImageKey
from generator_service.metrics import GeneratorMetrics

log = logging.getLogger(__name__)
SampleFn = Callable[[Sequence[ImageKey]], np.ndarray]


class QueueFull(Exception):
    """The request would push the number of queued images past the limit; the message says by how much."""


class BatcherClosed(Exception):
    """The batcher stopped (server shutdown) before the request finished."""


class SamplingFailed(Exception):
    """Sampling a batch raised; every request in that batch gets this (the server keeps running)."""


_DONE = object()


class Job:
    """One request's images, in the order they must be streamed; results arrive as consecutive chunks."""

    def __init__(self, keys: list[ImageKey]) -> None:
        self.keys = keys
        self.next = 0  # keys[:next] have been handed to a sampling batch
        self.enqueued_at = time.monotonic()
        self.cancelled = False
        self._results: queue.Queue[object] = queue.Queue()

    @property
    def remaining(self) -> int:
        return len(self.keys) - self.next

    def chunks(self) -> Iterator[np.ndarray]:
        """uint8 image arrays for keys[0:a], keys[a:b], ... until all are done; stops early if cancelled."""
        while True:
            item = self._results.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, np.ndarray)
            yield item


class Batcher:
    """One worker thread packs queued images, round-robin across requests, into batches of up to max_batch.

    It waits at most max_wait_s after the oldest queued request arrived for a batch to fill. sample_fn must
    give every image the same bytes whatever shares its batch (DdimSampler does)."""

    def __init__(self, sample_fn: SampleFn, *, max_batch: int, max_wait_s: float, queue_limit: int,
                 metrics: GeneratorMetrics | None = None) -> None:
        self._sample = sample_fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.queue_limit = queue_limit
        self._metrics = metrics
        self._jobs: list[Job] = []
        self._queued = 0
        self._closed = False
        self._cond = threading.Condition()
        self._worker = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._worker.start()

    @property
    def queued_images(self) -> int:
        with self._cond:
            return self._queued

    def submit(self, keys: list[ImageKey]) -> Job:
        job = Job(keys)
        with self._cond:
            if self._closed:
                raise BatcherClosed("the generator is shutting down")
            if self._queued + len(keys) > self.queue_limit:
                raise QueueFull(f"queue full: {self._queued} images queued + {len(keys)} requested "
                                f"> queue limit {self.queue_limit}; retry later or ask for fewer")
            self._jobs.append(job)
            self._set_queued(self._queued + len(keys))
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """Drop the job's queued images; a batch already sampling finishes but its images are discarded."""
        self._drop(job, _DONE)

    def _drop(self, job: Job, final: object) -> None:
        with self._cond:
            if job.cancelled:
                return
            job.cancelled = True
            if job in self._jobs:
                self._jobs.remove(job)
                self._set_queued(self._queued - job.remaining)
        job._results.put(final)

    def close(self, wait_s: float = 60.0) -> bool:
        """Fail every queued request and stop the worker; False if a batch was still sampling after wait_s (its
        images are discarded; the worker is a daemon thread and ends with it)."""
        with self._cond:
            self._closed = True
            jobs, self._jobs = self._jobs, []
            self._set_queued(0)
            self._cond.notify_all()
        for job in jobs:
            job._results.put(BatcherClosed("the generator shut down before the request finished"))
        self._worker.join(timeout=wait_s)
        return not self._worker.is_alive()

    def _set_queued(self, value: int) -> None:
        self._queued = value
        if self._metrics:
            self._metrics.queued_images.set(value)

    def _take_batch(self) -> list[tuple[Job, int, int]] | None:
        """Wait for work, then take up to max_batch keys round-robin: [(job, start, stop)] slices of job.keys."""
        with self._cond:
            while not self._jobs and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            fill_by = min(job.enqueued_at for job in self._jobs) + self.max_wait_s
            while self._queued < self.max_batch and not self._closed and (left := fill_by - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._closed or not self._jobs:
                return None if self._closed else []
            taken = {id(job): 0 for job in self._jobs}
            total = 0
            while total < self.max_batch and any(job.remaining > taken[id(job)] for job in self._jobs):
                for job in self._jobs:
                    if total < self.max_batch and job.remaining > taken[id(job)]:
                        taken[id(job)] += 1
                        total += 1
            now = time.monotonic()
            slices = []
            for job in list(self._jobs):
                n = taken[id(job)]
                if n == 0:
                    continue
                if job.next == 0 and self._metrics:
                    self._metrics.queue_wait.observe(now - job.enqueued_at)
                slices.append((job, job.next, job.next + n))
                job.next += n
                if job.remaining == 0:
                    self._jobs.remove(job)
            self._set_queued(self._queued - total)
            return slices

    def _run(self) -> None:
        while (slices := self._take_batch()) is not None:
            if not slices:
                continue
            keys = [key for job, start, stop in slices for key in job.keys[start:stop]]
            started = time.perf_counter()
            unservable: PartlyUnservable | None = None
            try:
                images = self._sample(keys)
            except PartlyUnservable as exc:  # e.g. the quality filter's budget ran out for one class
                log.warning("%d of %d images in a batch cannot be served: %s", len(exc.failed_rows), len(keys), exc)
                images, unservable = exc.images, exc
            except Exception as exc:  # a sampling failure fails the requests in this batch, not the server
                log.exception("sampling a batch of %d images failed", len(keys))
                for job, _, _ in slices:
                    self._drop(job, SamplingFailed(f"{type(exc).__name__}: {exc}"))
                continue
            if self._metrics:
                self._metrics.device_seconds.inc(time.perf_counter() - started)
                self._metrics.batch_size.observe(len(keys))
            offset = 0
            for job, start, stop in slices:
                if unservable is not None and any(offset <= row < offset + stop - start for row in unservable.failed_rows):
                    self._drop(job, Unservable(str(unservable)))  # only the requests that asked for a failed image
                elif not job.cancelled:
                    job._results.put(images[offset : offset + stop - start])
                    if stop == len(job.keys):
                        job._results.put(_DONE)
                offset += stop - start
