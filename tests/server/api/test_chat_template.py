"""A base model (no chat template) over HTTP: /v1/completions serves, /v1/chat/completions answers 400
model_not_chat, unless SIMMER_CHAT_TEMPLATE names a template file."""

from __future__ import annotations

import time

import openai
import pytest

from models.errors import InvalidParameter
from models.runtime.engine import load_engine
from server.launch import gate_for
from server.serving.engine_config import chat_template_override
from server.serving.model_setup import serve_folders
from tests import chat_templates
from tests.server.conftest import make_settings
from tests.server.fakes import RecordingEngine

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0}


def wait_loaded(srv) -> None:
    with srv.client() as c:
        for _ in range(500):
            if c.get("/health").json()["status"] != "loading":
                return
            time.sleep(0.02)


@pytest.fixture
def base_server(live, tiny_base_model_dir):
    engine = RecordingEngine(load_engine(tiny_base_model_dir, variant="q4", threads=1, context_length=128))
    return live(engine=engine, model=engine.model_id)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_when_model_has_no_template_then_400_model_not_chat(base_server, stream: bool) -> None:
    with base_server.client() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["code"], err["type"]) == ("model_not_chat", "invalid_request_error")
        assert err["param"] == "model"
        assert "/v1/completions" in err["message"] and "SIMMER_CHAT_TEMPLATE" in err["message"]
        # the connection stays usable and completions are served
        ok = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_chat_when_model_has_no_template_then_openai_sdk_gets_bad_request(base_server) -> None:
    client = openai.OpenAI(base_url=base_server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-base", **CHAT)
    assert err.value.code == "model_not_chat"


def test_chat_when_simmer_chat_template_names_a_file_then_base_model_chats(
    live, tmp_path, tiny_base_model_dir
) -> None:
    template = tmp_path / "chatml.jinja"
    template.write_text(chat_templates.QWEN25)
    settings = make_settings(tmp_path, thermal_source="none", context_length=128, chat_template=template)
    served = serve_folders(settings, [tiny_base_model_dir])
    srv = live(
        served=served,
        governor=gate_for(settings, served),
        thermal_source="none",
        context_length=128,
        chat_template=template,
    )
    wait_loaded(srv)
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    # the prompt is the template's: Qwen's default system turn plus the user turn
    assert r.json()["usage"]["prompt_tokens"] > 20


def test_chat_template_override_when_file_missing_then_clear_error(tmp_path) -> None:
    assert chat_template_override(make_settings(tmp_path)) is None
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert chat_template_override(make_settings(tmp_path, chat_template=path)) == "{{ messages }}"
    with pytest.raises(InvalidParameter, match=r"SIMMER_CHAT_TEMPLATE: cannot read .*nope\.jinja"):
        chat_template_override(make_settings(tmp_path, chat_template=tmp_path / "nope.jinja"))
