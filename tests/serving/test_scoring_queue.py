"""Serving: the MLflow server's scoring queue (`serving.scoring_queue`) on its own, with stand-in models: a model
that answers the wrong number of rows never hands a request its neighbour's answers, a client that goes away
while queued costs the others nothing, batches keep to `MAX_BATCH_TEXTS`, and the model thread starts once
however many threads submit its first calls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from pipeline.deployment.coalescing import MAX_BATCH_TEXTS
from serving.scoring_queue import ModelThread, ScoringQueue
from tests.factories import concurrently


def echo(texts: list[str]) -> list[Any]:
    """One record per text that names it, so a shifted slice shows."""
    return [{"text": t} for t in texts]


class HeldModel:
    """A stand-in model that records how many texts each call gets and answers (`answer`) only once released, so
    the requests that arrive meanwhile queue behind its call."""

    def __init__(self, answer: Callable[[list[str]], list[Any]] = echo) -> None:
        self.answer, self.calls, self.gate = answer, [], threading.Event()

    def __call__(self, texts: list[str]) -> list[Any]:
        self.calls.append(len(texts))
        self.gate.wait(5)
        return self.answer(texts)

    def release(self) -> None:
        self.gate.set()


def test_a_model_that_answers_the_wrong_number_of_rows_fails_every_request_and_shifts_no_answer():
    model = HeldModel(lambda texts: echo(texts)[:-1])  # one row short
    scoring = ScoringQueue(model, timeout_s=10)

    async def scenario() -> list[tuple[int, list[Any], str]]:
        first = asyncio.create_task(scoring.scored(["a0", "a1"], "a"))
        await asyncio.sleep(0.05)  # the model is busy with the first: the others queue behind it, as one batch
        rest = [asyncio.create_task(scoring.scored([f"r{i}-0", f"r{i}-1"], f"r{i}")) for i in range(6)]
        await asyncio.sleep(0.05)
        model.release()
        return await asyncio.gather(first, *rest)

    answers = asyncio.run(scenario())
    assert [status for status, _, _ in answers] == [500] * 7
    assert all(predictions == [] and "answered" in detail for _, predictions, detail in answers)
    assert model.calls[:2] == [2, 12] and model.calls[2:] == [2] * 6  # the batch failed, then each request alone


def test_a_request_cancelled_while_queued_leaves_the_others_answered():
    model = HeldModel()
    scoring = ScoringQueue(model, timeout_s=10)

    async def scenario() -> list[tuple[int, list[Any], str]]:
        first = asyncio.create_task(scoring.scored(["first"], "first"))
        await asyncio.sleep(0.05)
        queued = [asyncio.create_task(scoring.scored([f"q{i}"], f"q{i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        queued[1].cancel()  # its client went away while it waited
        model.release()
        return await asyncio.gather(first, queued[0], queued[2])

    answers = asyncio.run(scenario())
    assert answers == [(200, [{"text": "first"}], ""), (200, [{"text": "q0"}], ""), (200, [{"text": "q2"}], "")]


def test_queued_requests_are_batched_up_to_max_batch_texts_and_a_larger_one_goes_alone():
    model = HeldModel()
    scoring = ScoringQueue(model, timeout_s=10)
    sizes = [1, *[10] * 9, MAX_BATCH_TEXTS + 36, 5]

    def request(i: int) -> asyncio.Task[tuple[int, list[Any], str]]:
        return asyncio.create_task(scoring.scored([f"{i}-{j}" for j in range(sizes[i])], str(i)))

    async def scenario() -> list[tuple[int, list[Any], str]]:
        tasks = [request(0)]
        await asyncio.sleep(0.05)  # the first is on the model; the rest queue behind it
        tasks += [request(i) for i in range(1, len(sizes))]
        await asyncio.sleep(0.05)
        model.release()
        return await asyncio.gather(*tasks)

    answers = asyncio.run(scenario())
    assert all(status == 200 for status, _, _ in answers)
    assert [[p["text"] for p in predictions] for _, predictions, _ in answers] == \
        [[f"{i}-{j}" for j in range(n)] for i, n in enumerate(sizes)]
    assert model.calls == [1, 60, 30, MAX_BATCH_TEXTS + 36, 5]  # oldest first, within the cap but the lone one
    assert sum(model.calls) == sum(sizes)


# a second start of the thread, which a race on the first call would make, raises inside the thread's bootstrap:
# that is an unraisable exception, a failure here
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_the_model_thread_starts_once_however_many_threads_submit_its_first_calls():
    """32 threads submit their first calls at once (`concurrently`'s barrier): the thread starts once, every call
    is answered with its own result, in one thread."""
    model = ModelThread()
    ran_on: set[int] = set()

    def call(i: int) -> int:
        ran_on.add(threading.get_ident())
        return i * i

    assert concurrently(lambda i: model.submit(call, i).result(5), 32, 32) == [i * i for i in range(32)]
    assert len(ran_on) == 1 and threading.get_ident() not in ran_on
