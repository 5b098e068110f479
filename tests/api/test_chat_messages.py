"""Chat messages in every shape OpenAI's clients send, rendered by the model's chat template."""
import pytest

from control_plane import chat
from control_plane.sampling_params import ValidationError


def render(tok, messages, tools=None, **body):
    return tok.decode(chat.render(tok, chat.normalize_messages(messages), tools, chat.template_options(body)))


def test_text_parts_are_joined_and_developer_is_system(smol_tokenizer):
    text = render(smol_tokenizer, [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "one"},
                                                                {"type": "text", "text": "two"}], "name": "ann"}])
    assert "<|im_start|>system\nbe brief<|im_end|>" in text
    assert "<|im_start|>user\none\ntwo<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the same conversation as plain strings renders identically
    assert text == render(smol_tokenizer, [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "one\ntwo"}])


@pytest.mark.parametrize("part,named", [({"type": "image_url", "image_url": {"url": "x"}}, "'image_url'"),
                                        ({"type": "input_audio"}, "'input_audio'"), ({"text": "x"}, "without")])
def test_other_part_types_are_refused_by_name(part, named):
    with pytest.raises(ValidationError) as info:
        chat.normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, part]}])
    assert info.value.code == "unsupported_content_part" and named in info.value.message
    assert "content[1]" in info.value.message


def test_tool_history_reaches_a_template_without_tool_support(smol_tokenizer):
    """SmolLM2's template prints role and content only: calls and tools are folded into the text."""
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    text = render(smol_tokenizer, messages, tools)
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert '<tools>\n{"name": "weather"' in text


class ToolTemplateTokenizer:
    """A tokenizer whose template prints tools and calls itself: they must reach it unchanged."""
    chat_template = "{{ tools }} {% for m in messages %}{{ m.tool_calls }}{% endfor %}"

    def apply_chat_template(self, messages, tools=None, tokenize=True, **options):
        self.seen = (messages, tools, options)
        return [1, 2, 3]


def test_a_template_with_tools_gets_them_and_parsed_arguments():
    tok = ToolTemplateTokenizer()
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = chat.normalize_messages([{"role": "user", "content": "x"}, {
        "role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                             "function": {"name": "f", "arguments": '{"k": 1}'}}]}])
    assert chat.render(tok, messages, tools, chat.template_options({"chat_template_kwargs": {"flag": 1}})) == [1, 2, 3]
    seen_messages, seen_tools, options = tok.seen
    assert seen_tools == tools and seen_messages[1]["tool_calls"][0]["function"]["arguments"] == {"k": 1}
    assert options == {"add_generation_prompt": True, "continue_final_message": False, "flag": 1}


def test_continue_final_message_and_generation_prompt(smol_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}]
    text = render(smol_tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello the")
    plain = render(smol_tokenizer, messages[:1], add_generation_prompt=False)
    assert plain.endswith("hi<|im_end|>\n")
    with pytest.raises(ValidationError, match="add_generation_prompt"):
        chat.template_options({"continue_final_message": True})
    with pytest.raises(ValidationError, match="last message"):
        render(smol_tokenizer, messages[:1], add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("messages,fragment", [
    ([{"role": "robot", "content": "x"}], "role must be one of"),
    ([{"role": "user"}], "needs a 'content'"),
    ([{"role": "tool", "content": "x"}], "tool_call_id"),
    ([{"role": "user", "content": "x", "colour": 1}], "'colour'"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], "not valid JSON"),
    ([{"role": "user", "content": 5}], "must be a string"),
    ([], "non-empty"),
])
def test_bad_messages_are_named(messages, fragment):
    with pytest.raises(ValidationError, match=fragment):
        chat.normalize_messages(messages)


def test_chat_template_kwargs_cannot_replace_the_request_fields():
    with pytest.raises(ValidationError, match="'tokenize'"):
        chat.template_options({"chat_template_kwargs": {"tokenize": False}})
