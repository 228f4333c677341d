"""The example's tools template (``examples/chatml_tools.jinja``, ``gateway.chat_template``)
on the real model's tokenizer: plain chats render as SmolLM2's own template renders them, and
a tool call the model sampled continues token-exact."""

from __future__ import annotations

from areal_clients.gateway.chat import ChatRenderer, Conversation, normalize_messages
from areal_clients.gateway.tools import ToolSettings, assistant_message
from arealgrpc.v1 import common_pb2, rollout_pb2

from areal_grpc.config import read_chat_template
from areal_grpc.model import load_tokenizer
from tests.support.paths import ROOT

TEMPLATE = ROOT / "examples" / "chatml_tools.jinja"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def test_without_tools_the_example_template_renders_as_the_models_own(real_model_dir):
    tokenizer = load_tokenizer(real_model_dir)
    ours, own = ChatRenderer(tokenizer, read_chat_template(str(TEMPLATE))), ChatRenderer(tokenizer)
    assert ours.takes_tools and not own.takes_tools
    for messages in [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2 + 3?"},
        ],
    ]:
        for prompt in (True, False):
            assert ours.text(messages, prompt) == own.text(messages, prompt)


def test_a_sampled_tool_call_of_the_real_model_continues_from_its_sampled_ids(real_model_dir):
    tokenizer = load_tokenizer(real_model_dir)
    renderer = ChatRenderer(tokenizer, read_chat_template(str(TEMPLATE)))
    tools = [CALCULATOR]
    messages = normalize_messages(
        [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "What is 347 + 589?"},
        ]
    )
    conv = Conversation.start(messages, renderer, tools)
    assert conv.text.startswith("<|im_start|>system\nUse the calculator.\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in conv.text
    # No spaces where the template's JSON has them: re-rendering the call would change ids.
    text = '<tool_call>\n{"name":"calculator","arguments":{"expression":"347+589"}}\n</tool_call>'
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = [*tokenizer.encode(text, add_special_tokens=False), end]
    completion = rollout_pb2.Completion(
        output_ids=sampled,
        output_logprobs=[-0.1] * len(sampled),
        output_versions=[3] * len(sampled),
        finish_reason=common_pb2.FINISH_REASON_STOP,
    )
    message, kept = assistant_message(text, "chatcmpl-1", ToolSettings(tools, parse=True))
    assert message["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": '{"expression": "347+589"}',
    }
    conv.add_reply("chatcmpl-1", completion, text, kept)
    returned = {**message, "refusal": None, "function_call": None, "annotations": []}
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "936"}
    nxt = normalize_messages([*messages, returned, result])
    found = conv.continued_by(nxt, renderer, tools)
    assert found is not None
    ids, full = found
    conv.extend_prompt(nxt, ids, full)
    assert full.endswith("<|im_end|>\n<|im_start|>tool\n936<|im_end|>\n<|im_start|>assistant\n")
    traj = conv.trajectory(1.0, "t", "g")
    trained = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert trained == sampled
    # The re-rendered call is other ids: exactness came from keeping the sampled ones.
    assert renderer.encode(renderer.text(nxt, tools=tools)) != traj.token_ids
