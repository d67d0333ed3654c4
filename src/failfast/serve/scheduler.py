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
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from failfast.decode.engine import DecodeBatch, GenerationRequest, GenerationResult, SpeculativeEngine
from failfast.errors import FailfastError
from failfast.serve.streaming import TextStream

log = logging.getLogger("failfast.serve")


class QueueFull(FailfastError):
    """The server's queue of waiting requests is full; retry later."""


class Unavailable(FailfastError):
    """The scheduler is shutting down or has stopped after a fatal error."""


@dataclass
class Job:
    """A submitted request and where its events go (called on the scheduler thread)."""

    request: GenerationRequest
    on_text: Callable[[str], None] | None  # None: not streamed (no text deltas are computed)
    on_done: Callable[[GenerationResult], None]
    on_error: Callable[[Exception], None]
    submitted: float = field(default_factory=time.perf_counter)
    first_text_s: float | None = None  # seconds from submission to the first streamed text
    cancelled: bool = False
    stream: TextStream | None = None


class Scheduler:
    def __init__(self, engine: SpeculativeEngine, max_batch: int, max_queue: int, max_total: int,
                 max_new_tokens: int, on_round: Callable[[int, int], None] = lambda running, waiting: None) -> None:
        if max_batch < 1 or max_queue < 1:
            raise FailfastError(f"the server needs >= 1 batch slot and queue place, got {max_batch} and {max_queue}")
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
        self._decode = engine.target.tokenizer.decode  # the app refuses a target without a tokenizer
        self._jobs: dict[int, Job] = {}  # id(job) -> job, for the rows in the batch
        self.broken: Exception | None = None  # why the thread stopped serving, if it did
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
        if job.on_text is not None:
            job.stream = TextStream(self._decode, job.request.stop)
        with self._wake:
            if self._stopping or self.broken is not None:
                raise Unavailable("the server is not serving (see its log)")
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
            batch: DecodeBatch | None = None
            while True:
                with self._wake:
                    while not self._stopping and not self._waiting and not self._jobs:
                        self._wake.wait()
                    if self._stopping:
                        break
                try:
                    batch = batch or self._new_batch()
                except Exception as exc:  # no batch can be built (e.g. out of memory): stop serving
                    log.exception("cannot allocate a batch; the scheduler stops")
                    self.broken = exc
                    break
                try:
                    self._round(batch)
                except Exception as exc:  # a bug or an exhausted device in a round: fail this batch, go on
                    log.exception("a decoding round failed; failing its %d requests", len(self._jobs))
                    self._fail(list(self._jobs.values()), exc)
                    self._jobs.clear()
                    batch = None  # released before the next one is allocated
        with self._wake:
            left, self._waiting = list(self._jobs.values()) + list(self._waiting), deque()
        self._fail(left, self.broken or FailfastError("the server is shutting down"))

    @property
    def healthy(self) -> bool:
        return self.broken is None and self._thread.is_alive()

    def _round(self, batch: DecodeBatch) -> None:
        """Drop cancelled rows, fill free slots from the queue, decode one round, publish."""
        for key in [k for k, job in self._jobs.items() if job.cancelled]:
            batch.cancel(key)
            del self._jobs[key]
            self.freed_rows += 1
        with self._wake:
            joining = [self._waiting.popleft() for _ in range(min(batch.free_slots, len(self._waiting)))]
        for job in joining:
            self._join(batch, job)
        finished = batch.step()
        self._publish(batch, finished)
        self.on_round(batch.running, len(self._waiting))

    @staticmethod
    def _fail(jobs: list[Job], exc: Exception) -> None:
        for job in jobs:
            if not job.cancelled:
                job.on_error(exc)

    def _new_batch(self) -> DecodeBatch:
        return self.engine.open_batch(self.max_batch, self.max_total, self.max_new_tokens)

    def _join(self, batch: DecodeBatch, job: Job) -> None:
        try:
            batch.add(id(job), job.request)
        except Exception as exc:  # e.g. a policy that cannot be built: this request only
            log.exception("a request could not join the batch")
            job.on_error(exc)
            return
        self._jobs[id(job)] = job

    def _publish(self, batch: DecodeBatch, finished: list[tuple[int, GenerationResult]]) -> None:
        """New text for every running job, the result for every finished one; a job whose
        text cannot be streamed fails alone (and leaves the batch)."""
        for key, generated in batch.generated().items():
            job = self._jobs[key]
            try:
                if job.stream is not None and not job.cancelled and (text := job.stream.update(generated)):
                    self._send_text(job, text)
            except Exception as exc:
                log.exception("streaming a request's text failed")
                batch.cancel(key)
                del self._jobs[key]
                job.on_error(exc)
        for key, result in finished:
            job = self._jobs.pop(key)
            if job.cancelled:
                continue
            try:
                result = replace(result, text=self._text(result))
                if job.stream is not None and (text := job.stream.finish(result.text)):
                    self._send_text(job, text)
            except Exception as exc:
                log.exception("finishing a request's text failed")
                job.on_error(exc)
                continue
            job.on_done(result)

    def _text(self, result: GenerationResult) -> str:
        """A client's text: the output without the end-of-sequence token's own text."""
        ids = result.token_ids[:-1] if result.stop_reason == "eos" else result.token_ids
        return result.text if result.stop_reason == "stop" else self._decode(ids)

    @staticmethod
    def _send_text(job: Job, text: str) -> None:
        if job.first_text_s is None:
            job.first_text_s = time.perf_counter() - job.submitted
        job.on_text(text)
