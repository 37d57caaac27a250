"""The playground's form in a real headless browser (tests/serve/api/routes/test_playground.py's Browser), against the
real server on 127.0.0.1: the sampler select is the server's own list with its default chosen, and a
prompt streams previews of the continuation where /v1/generate takes one, else the page says why
there are none. Without chromium these tests skip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")

from ldlm.model.config import SAMPLERS  # noqa: E402
from ldlm.pipeline import LDLMPipeline  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.serve.api.routes.test_playground import CHROMIUM, Browser, run_page  # noqa: E402
from tests.serve.api.routes.test_playground_defaults import tuned_checkpoint  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium on PATH (scripts/test.sh installs it: apt-get install -y chromium); the sampler select and "
    "prompted previews were not exercised in a browser",
)
PROMPT = "Once upon a time"


def serve(export_dir: Path, prompted: bool) -> RunningServer:
    """The tiny export behind the production app; ``prompted`` False: a server whose /v1/generate body has no
    ``prompt`` field (an older server), for the page's fallback. Previews may take half the time (the run is short)."""
    from ldlm.serve.api import schemas

    settings = ServerSettings(
        port=free_port(), max_batch=8, request_timeout_s=60, max_n=8, max_steps=1000, preview_budget=0.5, preview_lone_budget=1.0
    )
    with pytest.MonkeyPatch.context() as patch:
        if not prompted:
            patch.setattr(schemas, "generate_body_model", without_prompt(schemas.generate_body_model))
        return RunningServer(LDLMService(str(export_dir), settings))


def without_prompt(build: Any) -> Any:
    """``build`` (schemas.generate_body_model) without its ``prompt`` field."""
    from pydantic import create_model

    from ldlm.serve.api import schemas

    def model(limits: Any) -> Any:
        fields = {name: (info.annotation, info) for name, info in build(limits).model_fields.items() if name != "prompt"}
        return create_model("GenerateBody", __base__=schemas.GenerateFields, **fields)

    return model


@pytest.fixture(scope="module")
def server(export_dir: Path):
    running = serve(export_dir, prompted=False)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def prompted_server(export_dir: Path):
    running = serve(export_dir, prompted=True)
    yield running
    running.stop()


@pytest.fixture()
def browser():
    opened = Browser()
    yield opened
    opened.close()


def test_the_sampler_select_lists_the_servers_samplers_and_its_choice_is_sent(
    prompted_server: RunningServer, browser: Browser, pipeline: LDLMPipeline
) -> None:
    browser.open(prompted_server.url + "/")
    browser.wait_for("document.body.dataset.schema === 'ready'")
    options = browser.evaluate("[...document.getElementById('sampler').options].map(o => o.value)")
    assert options == ["", *SAMPLERS]  # the server's own choice (nothing sent), then its own list from its OpenAPI schema
    assert browser.evaluate("document.getElementById('sampler').value") == ""
    first = browser.evaluate("document.getElementById('sampler').options[0].textContent")
    assert first == f"server default ({pipeline.config.default_sampler})"
    assert run_page(browser, "", sampler="ddim") == "done"
    # the independent reference: the eager pipeline with the sampler chosen on the page
    assert (
        browser.evaluate("document.getElementById('preview').textContent") == pipeline.generate(1, 12, 20, seed=5, sampler="ddim").texts[0]
    )


@pytest.fixture(scope="module")
def tuned_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server whose default sampler runs 3 tuned steps by default (its schedules.json), not the config's default_steps;
    every preview asked for is sent (the run is short)."""
    ckpt, _ = tuned_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("tuned"))
    running = RunningServer(
        LDLMService(str(ckpt), ServerSettings(port=free_port(), backend="eager", preview_budget=1.0, preview_lone_budget=1.0))
    )
    yield running, ckpt
    running.stop()
    running.service.close()


def sent_bodies(browser: Browser) -> list[dict[str, Any]]:
    return [
        json.loads(e["params"]["request"]["postData"])
        for e in browser.events
        if e.get("method") == "Network.requestWillBeSent" and e["params"]["request"]["url"].endswith("/v1/generate")
    ]


def test_steps_left_empty_are_the_servers_default_shown_and_not_sent(tuned_server: Any, browser: Browser) -> None:
    running, ckpt = tuned_server
    config = LDLMPipeline.from_checkpoint(ckpt).config
    browser.open(running.url + "/")
    browser.wait_for("document.body.dataset.schema === 'ready'")
    placeholder = "document.getElementById('steps').placeholder"
    assert browser.evaluate("document.getElementById('steps').value") == ""
    assert browser.evaluate(placeholder) == "server's: 3"  # the tuned default, from the server
    browser.evaluate("(() => { const s = document.getElementById('sampler'); s.value = 'ddim'; s.dispatchEvent(new Event('change')); })()")
    assert browser.evaluate(placeholder) == f"server's: {config.default_steps}"  # an untuned sampler: the config's
    browser.evaluate("(() => { const s = document.getElementById('sampler'); s.value = ''; s.dispatchEvent(new Event('change')); })()")
    browser.evaluate("""(() => { const set = (id, v) => document.getElementById(id).value = v;
                        set('length', 12); set('seed', 5); set('every', 1); document.getElementById('go').click(); })()""")
    browser.wait_for("['done', 'error'].includes(document.body.dataset.state)", 60)
    assert browser.evaluate("document.getElementById('status').textContent") == "Done: 3 steps, 2 previews."
    assert [sorted(body) for body in sent_bodies(browser)] == [["length", "n", "preview_every", "seed", "stream"]]
    expected = LDLMPipeline.from_checkpoint(ckpt).generate(1, 12, 3, 5, config.default_sampler, grid="tuned").texts[0]
    assert browser.evaluate("document.getElementById('preview').textContent") == expected


def test_an_error_clears_the_previous_result(tuned_server: Any, browser: Browser) -> None:
    running, _ = tuned_server
    browser.open(running.url + "/")
    browser.wait_for("document.body.dataset.schema === 'ready'")
    assert run_page(browser, "") == "done"
    assert browser.evaluate("document.getElementById('preview').textContent") != ""
    browser.evaluate("""(() => { document.getElementById('length').value = 4096; document.getElementById('go').click(); })()""")
    browser.wait_for("['done', 'error'].includes(document.body.dataset.state)", 60)
    assert browser.evaluate("document.body.dataset.state") == "error"
    assert "4096 is out of range" in browser.evaluate("document.getElementById('status').textContent")
    assert browser.evaluate("document.getElementById('preview').textContent") == ""  # not the earlier run's text under the error
    assert not browser.evaluate("document.getElementById('preview').classList.contains('final')")


def test_a_prior_temperature_typed_on_the_page_is_sent(server: RunningServer, browser: Browser, pipeline: LDLMPipeline) -> None:
    browser.open(server.url + "/")
    browser.wait_for("document.body.dataset.schema === 'ready'")
    assert run_page(browser, "", sampler="ddim", prior_temperature=0.5) == "done"
    cooled = pipeline.generate(1, 12, 20, seed=5, sampler="ddim", prior_temperature=0.5).texts[0]
    assert cooled != pipeline.generate(1, 12, 20, seed=5, sampler="ddim").texts[0]
    assert browser.evaluate("document.getElementById('preview').textContent") == cooled


def test_with_a_prompt_the_page_shows_previews_of_the_continuation(
    prompted_server: RunningServer, browser: Browser, pipeline: LDLMPipeline
) -> None:
    browser.open(prompted_server.url + "/")
    browser.wait_for("document.body.dataset.schema === 'ready'")
    browser.evaluate(f"document.getElementById('prompt').value = {json.dumps(PROMPT)}")
    assert run_page(browser, "", sampler="ddim") == "done"
    # an idle server sends every preview asked for: steps 5, 10 and 15 of 20
    assert browser.evaluate("document.getElementById('status').textContent") == "Done: 20 steps, 3 previews."
    expected = pipeline.generate(1, 12, 20, seed=5, sampler="ddim", prompt=PROMPT).texts[0]  # 12 tokens, the prompt's included
    assert expected.startswith(PROMPT)
    assert browser.evaluate("document.getElementById('preview').textContent") == expected  # the prompt once, then what follows


def test_with_a_prompt_on_a_server_without_prompted_previews_the_page_says_so(server: RunningServer, browser: Browser) -> None:
    browser.open(server.url + "/")
    browser.evaluate(f"document.getElementById('prompt').value = {json.dumps(PROMPT)}")
    assert run_page(browser, "") == "done"
    assert "its /v1/generate takes no prompt" in browser.evaluate("document.getElementById('status').textContent")
