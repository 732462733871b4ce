"""`regenerate_turns` prompts through the real client: each follow-up is sent after the target's own
answer, over HTTP to an OpenAI-compatible server on loopback; a failed turn fails the prompt, named.

Run: .venv/bin/python -m pytest tests/integration/test_multi_turn_generation.py -q
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_core.data.completion import Message
from dflash_core.data.prompts import PromptRecord
from dflash_core.serving.client import ClientConfig, FailedPrompt, SamplingParams, complete_all


class _ChatServer(BaseHTTPRequestHandler):
    """Answers "answer N" for a conversation with N user turns; refuses more than `max_user_turns`."""

    max_user_turns = 99
    seen: list[list[dict]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        messages = body["messages"]
        type(self).seen.append(messages)
        users = sum(m["role"] == "user" for m in messages)
        if users > self.max_user_turns:
            self._send(400, {"error": f"{users} user turns is too many"})
            return
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": f"answer {users}"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def chat_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _ChatServer.seen, _ChatServer.max_user_turns = [], 99
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _run(url: str, prompt: PromptRecord):
    async def collect():
        return [r async for r in complete_all([prompt], urls=[url], model="m", server="test",
                                              sampling=SamplingParams(max_tokens=8),
                                              config=ClientConfig(max_attempts=1, backoff_s=0))]
    return asyncio.run(collect())[0]


PROMPT = PromptRecord(id="c1", source="sg", messages=[Message(role="user", content="first")],
                      followups=["second", "third"])


def test_each_followup_is_asked_after_the_targets_own_answer(chat_server):
    record = _run(chat_server, PROMPT)
    assert not isinstance(record, FailedPrompt), record
    assert record.regenerated and record.content == "answer 3"
    assert [(m.role, m.content) for m in record.prompt] == [
        ("user", "first"), ("assistant", "answer 1"), ("user", "second"), ("assistant", "answer 2"),
        ("user", "third")]
    assert record.generation.extra["turns_answered"] == 3 and record.generation.extra["turns_total"] == 3
    assert [len(m) for m in _ChatServer.seen] == [1, 3, 5]


def test_a_failed_turn_fails_the_prompt_and_names_the_turn(chat_server):
    _ChatServer.max_user_turns = 1
    failed = _run(chat_server, PROMPT)
    assert isinstance(failed, FailedPrompt) and failed.id == "c1"
    assert failed.error.startswith("turn 2 of 3: HTTP 400") and "2 user turns is too many" in failed.error
