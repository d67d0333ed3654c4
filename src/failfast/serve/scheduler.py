"""One thread runs the batch-first engine for every request of the server.

Requests wait in a bounded queue, join the running batch when a slot is free and leave it
when they finish or are cancelled, between rounds (continuous batching). After every round
each running request gets its new text (`streaming.TextStream`) and each finished one its
result, through the callbacks it was submitted with. An error inside a round fails only
the requests of that batch; the thread goes on with a fresh batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from failfast.decode.engine import DecodeBatch, GenerationRequest, GenerationResult, SpeculativeEngine
from failfast.errors import FailfastError
from failfast.serve.streaming import TextStream

log = logging.getLogger("failfast.serve")


class QueueFull(FailfastError):
    """The server's queue of waiting requests is full; retry later."""


@dataclass
class Job:
    """A submitted request and where its events go (called on the scheduler thread)."""

    request: GenerationRequest
    on_text: Callable[[str], None]
    on_done: Callable[[GenerationResult], None]
    on_error: Callable[[Exception], None]
    submitted: float = field(default_factory=time.perf_counter)
    first_text_s: float | None = None  # seconds from submission to the first text sent
    cancelled: bool = False
    stream: TextStream | None = None


class Scheduler:
    def __init__(self, engine: SpeculativeEngine, max_batch: int, max_queue: int, max_total: int,
                 max_new_tokens: int, on_round: Callable[[int, int], None] = lambda running, waiting: None) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_total = max_total
        self.max_new_tokens = max_new_tokens
        self.on_round = on_round  # (running, waiting) after every round: the server's gauges
        self._waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="failfast-scheduler", daemon=True)
        self._decode = engine.target.tokenizer.decode if engine.target.tokenizer else lambda ids: ""
        self._jobs: dict[int, Job] = {}  # id(job) -> job, for the rows in the batch
        self.freed_rows = 0  # rows given up by cancelled jobs before they finished

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._jobs)

    def submit(self, job: Job) -> None:
        """Queue a checked request; raises QueueFull when `max_queue` requests already wait."""
        self.engine.check_request(job.request)
        job.stream = TextStream(self._decode, job.request.stop)
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting; retry later")
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Free the job's row at the next round (a client went away); no more callbacks."""
        with self._wake:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)

    def _run(self) -> None:
        with torch.inference_mode():
            batch = self._new_batch()
            jobs = self._jobs
            while True:
                with self._wake:
                    while not self._stopping and not self._waiting and not jobs:
                        self._wake.wait()
                    if self._stopping:
                        return
                    joining = [self._waiting.popleft() for _ in range(min(batch.free_slots, len(self._waiting)))]
                for key in [k for k, job in jobs.items() if job.cancelled]:
                    batch.cancel(key)
                    del jobs[key]
                    self.freed_rows += 1
                for job in joining:
                    self._join(batch, jobs, job)
                try:
                    finished = batch.step()
                except Exception as exc:  # a bug in a round: fail this batch, keep serving
                    log.exception("a decoding round failed; failing its %d requests", len(jobs))
                    for job in jobs.values():
                        job.on_error(exc)
                    jobs.clear()
                    batch = self._new_batch()
                    continue
                self._publish(batch, jobs, finished)
                self.on_round(batch.running, len(self._waiting))

    def _new_batch(self) -> DecodeBatch:
        return self.engine.open_batch(self.max_batch, self.max_total, self.max_new_tokens)

    def _join(self, batch: DecodeBatch, jobs: dict[int, Job], job: Job) -> None:
        try:
            batch.add(id(job), job.request)
        except Exception as exc:  # e.g. a policy that cannot be built: this request only
            log.exception("a request could not join the batch")
            job.on_error(exc)
            return
        jobs[id(job)] = job

    def _publish(self, batch: DecodeBatch, jobs: dict[int, Job], finished: list[tuple[int, GenerationResult]]) -> None:
        for key, generated in batch.generated().items():
            job = jobs[key]
            if not job.cancelled and (text := job.stream.update(generated)):
                self._send_text(job, text)
        for key, result in finished:
            job = jobs.pop(key)
            if job.cancelled:
                continue
            if text := job.stream.finish(result.text or ""):
                self._send_text(job, text)
            job.on_done(result)

    @staticmethod
    def _send_text(job: Job, text: str) -> None:
        if job.first_text_s is None:
            job.first_text_s = time.perf_counter() - job.submitted
        job.on_text(text)
