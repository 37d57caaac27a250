"""A full generation queue names its bound in the setting its owner set (a server's --max-queue), not only in
samples: the user of `--max-queue 2` never typed the 32 samples it allows."""

from __future__ import annotations

import pytest

from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest
from ldlm.serve.runtime.queueing import QueueFullError
from ldlm.serve.runtime.scheduler import GenerationScheduler


@pytest.mark.parametrize(("source", "shown"), [("--max-queue 2 requests x 16 samples", " (--max-queue 2 requests x 16 samples)"), ("", "")])
def test_a_full_queue_names_the_setting_behind_its_bound(pipeline: LDLMPipeline, source: str, shown: str) -> None:
    # not started: no thread takes samples off the queue, so what waits is what was submitted
    scheduler = GenerationScheduler(pipeline, max_batch=4, max_queue=32, start=False, max_queue_source=source)
    scheduler.submit(GenerateRequest(n=30, length=4, steps=2))
    with pytest.raises(QueueFullError) as refused:
        scheduler.submit(GenerateRequest(n=3, length=4, steps=2))
    assert str(refused.value) == (
        f"generation queue is full: 30 samples waiting and 3 asked, max 32 samples{shown}; retry later, or raise the limit"
    )
