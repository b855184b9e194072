"""data.chat: loss masks cover exactly the assistant replies (content + end-of-turn) under real chat templates."""

from __future__ import annotations

import pytest
from tiny import build_qwen3_tokenizer, build_tokenizer

from peagle_pipeline.data.chat import ChatRenderer, RejectRow
from peagle_pipeline.data.records import Message
from peagle_pipeline.errors import BadInput

END = {"chatml": "<|im_end|>", "chatml_system": "<|im_end|>", "llama3": "<|eot_id|>"}
CONV = [
    Message("system", "Be brief."),
    Message("user", "Hi there"),
    Message("assistant", " Hello! How are you? "),
    Message("user", "What is the capital of France?"),
    Message("assistant", "Paris is the capital.\n"),
    Message("user", "Thanks"),
    Message("assistant", ""),
]


@pytest.fixture(scope="module", params=["chatml", "llama3", "chatml_system"])
def tok(request, tmp_path_factory):
    return request.param, build_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


def masked_spans(tokenizer, sample) -> list[str]:
    """Decoded runs of consecutive supervised tokens."""
    spans, run = [], []
    for tid, m in zip(sample.input_ids, sample.loss_mask, strict=True):
        if m:
            run.append(tid)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


def expected_reply(template: str, content: str) -> str:
    return (content.strip() if template == "llama3" else content) + END[template]


@pytest.mark.parametrize("drop_system", [False, True])
def test_mask_is_exactly_assistant_content_and_end_token(tok, drop_system):
    template, tokenizer = tok
    conv = CONV[1:] if drop_system else CONV
    sample = ChatRenderer(tokenizer).render(conv)
    ref = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in conv], tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert sample.input_ids == list(ref)  # same ids as the template's own tokenisation
    assert len(sample.loss_mask) == len(sample.input_ids)
    replies = [
        m.content for m in conv if m.role == "assistant" and m.content.strip()
    ]  # the empty one is context
    assert masked_spans(tokenizer, sample) == [expected_reply(template, c) for c in replies]
    # Role headers, the (possibly injected) system prompt and user turns are never supervised.
    unsupervised = tokenizer.decode(
        [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
    )
    assert "assistant" in unsupervised and "Thanks" in unsupervised and "Paris" not in unsupervised


def test_last_turn_only(tok):
    template, tokenizer = tok
    conv = CONV[:5]
    sample = ChatRenderer(tokenizer, assistant_turns="last").render(conv)
    assert masked_spans(tokenizer, sample) == [expected_reply(template, "Paris is the capital.\n")]


def test_leading_assistant_context_or_drop(tok):
    template, tokenizer = tok
    conv = [Message("assistant", "Welcome back!"), Message("user", "Hi there"), Message("assistant", "Hello")]
    kept = ChatRenderer(tokenizer, leading_assistant="context").render(conv)
    dropped = ChatRenderer(tokenizer, leading_assistant="drop").render(conv)
    assert (
        masked_spans(tokenizer, kept)
        == masked_spans(tokenizer, dropped)
        == [expected_reply(template, "Hello")]
    )
    assert "Welcome" in tokenizer.decode(kept.input_ids) and "Welcome" not in tokenizer.decode(
        dropped.input_ids
    )
    assert len(kept.input_ids) > len(dropped.input_ids)
    with pytest.raises(RejectRow, match="no assistant turn"):
        ChatRenderer(tokenizer).render([Message("assistant", "Only me")])


def test_consecutive_assistant_turns_each_supervised(tok):
    template, tokenizer = tok
    conv = [Message("user", "Hi"), Message("assistant", "Hello"), Message("assistant", "Hello again")]
    sample = ChatRenderer(tokenizer).render(conv)
    assert masked_spans(tokenizer, sample) == [
        expected_reply(template, "Hello"),
        expected_reply(template, "Hello again"),
    ]


def test_no_chat_template_is_bad_input(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")
    tokenizer.chat_template = None
    with pytest.raises(BadInput, match="no chat template"):
        ChatRenderer(tokenizer)


def test_template_errors_and_unlocatable_content_reject_the_row(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | upper + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(RejectRow, match="chat template refused the conversation: no system role"):
        renderer.render(CONV)
    with pytest.raises(RejectRow, match="content was not found"):
        renderer.render([Message("user", "hi"), Message("assistant", "hello")])
    assert renderer.render([Message("user", "hi"), Message("assistant", "OK")]).num_supervised >= 2


# ---- OpenAI tool-call turns ---------------------------------------------------------------
# A Qwen2.5-like template that renders tool calls and tool results (simplified).
TOOLS_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' + m['content'] }}"
    "{% if m.tool_calls is defined and m.tool_calls %}{% for tc in m.tool_calls %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + tc['function']['name'] + '\", \"arguments\": ' }}"
    "{{ tc['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif m['role'] == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CONV = [
    Message("user", "Weather in Paris?"),
    Message("assistant", "", tool_calls=[CALL]),
    Message("tool", "18 C, sunny", tool_call_id="c1"),
    Message("assistant", "It is 18 C and sunny."),
]


def test_tool_calls_render_as_the_template_does_and_are_supervised(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")
    tokenizer.chat_template = TOOLS_TEMPLATE
    sample = ChatRenderer(tokenizer).render(TOOL_CONV)
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 18 C and sunny."},
    ]
    ref = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tokenizer.decode(sample.input_ids) == ref
    assert masked_spans(tokenizer, sample) == [
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 18 C and sunny.<|im_end|>",
    ]


def test_tool_calls_under_a_template_without_tool_support_reject_the_row(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")  # renders only role + content: the call would vanish
    with pytest.raises(RejectRow, match=r"the chat template does not render tool calls \(turn 1\)"):
        ChatRenderer(tokenizer).render(TOOL_CONV)


# ---- Qwen3's real template (an empty <think> block on the newest assistant turn) ---------------
@pytest.fixture(scope="module")
def qwen3_tok(tmp_path_factory):
    return build_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tok"))


def test_qwen3_tool_call_turns_are_supervised_as_the_template_writes_them(qwen3_tok):
    """Rendered as the server renders the whole conversation; each reply is what the template writes for it."""
    sample = ChatRenderer(qwen3_tok).render(TOOL_CONV)
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 18 C and sunny."},
    ]
    assert qwen3_tok.decode(sample.input_ids) == qwen3_tok.apply_chat_template(msgs, tokenize=False)
    assert masked_spans(qwen3_tok, sample) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 18 C and sunny.<|im_end|>",
    ]


def test_qwen3_tool_result_that_repeats_an_argument(qwen3_tok):
    """The tool answers with text that also appears in the call's arguments: the call is still found whole."""
    conv = [*TOOL_CONV[:2], Message("tool", "Paris", tool_call_id="c1"), TOOL_CONV[3]]
    sample = ChatRenderer(qwen3_tok).render(conv)
    assert masked_spans(qwen3_tok, sample)[0] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    )


def test_qwen3_tool_call_as_the_newest_turn_and_plain_multi_turn(qwen3_tok):
    renderer = ChatRenderer(qwen3_tok)
    sample = renderer.render(
        TOOL_CONV[:2]
    )  # the call is the newest turn: the template writes an empty think block
    assert masked_spans(qwen3_tok, sample) == [
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ]
    sample = renderer.render(CONV[1:5])
    assert masked_spans(qwen3_tok, sample) == [
        " Hello! How are you? <|im_end|>",  # an earlier reply, rendered as given (Qwen3 does not trim)
        "<think>\n\n</think>\n\nParis is the capital.\n<|im_end|>",
    ]


# ---- memory bounded by the max length ------------------------------------------------------
def _render_or_reason(renderer, conv, max_tokens=None):
    try:
        s = renderer.render(conv) if max_tokens is None else renderer.render(conv, max_tokens=max_tokens)
    except RejectRow as err:
        return err.reason
    return s


def _random_conversations(seed: int, n: int) -> list[list[Message]]:
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog Paris capital 0123 hello ! ? def add(a, b):".split()
    convs = []
    for _ in range(n):
        conv = [Message("system", "Be brief.")] if rng.random() < 0.3 else []
        if rng.random() < 0.2:
            conv.append(Message("assistant", "leading context"))
        for _ in range(rng.randint(1, 4)):
            for role in ("user", "assistant"):
                k = rng.choice([0, 1, 5, 40, 200, 1500])
                text = " ".join(rng.choice(words) for _ in range(k))
                if rng.random() < 0.15:
                    text += " " * rng.randint(1, 300) + "\n" * rng.randint(0, 3)  # whitespace before the end
                conv.append(Message(role, text))
        convs.append(conv)
    return convs


@pytest.mark.parametrize("max_tokens", [2, 9, 40, 300])
def test_bounded_render_equals_the_whole_render_cut_to_max_tokens(tok, max_tokens):
    """render(..., max_tokens=n) tokenises only a prefix of long conversations, yet gives exactly the first n ids
    and mask values of the whole rendering (and the same reject reasons)."""
    template, tokenizer = tok
    for drop in (False, True):
        renderer = ChatRenderer(
            tokenizer, assistant_turns="all", leading_assistant="drop" if drop else "context"
        )
        bounded = 0
        for conv in _random_conversations(max_tokens, 30):
            whole = _render_or_reason(renderer, conv)
            cut = _render_or_reason(renderer, conv, max_tokens)
            if isinstance(whole, str):
                assert cut == whole
                continue
            assert not isinstance(cut, str), cut
            assert cut.input_ids == whole.input_ids[: len(cut.input_ids)]
            assert cut.loss_mask == whole.loss_mask[: len(cut.input_ids)]
            assert len(cut.input_ids) == min(len(whole.input_ids), max(max_tokens, len(cut.input_ids)))
            bounded += len(cut.input_ids) < len(whole.input_ids)
        assert bounded > 0  # the bounded path was taken


class _Spy:
    """The real tokenizer, recording the length of every text it tokenises."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.lengths: list[int] = []

    def __call__(self, text, **kw):
        self.lengths.append(len(text))
        return self._tokenizer(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_huge_conversation_is_tokenised_only_as_far_as_max_tokens_needs(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")
    spy = _Spy(tokenizer)
    renderer = ChatRenderer(spy)
    huge = [
        Message("user", "tell me everything " * 60_000),  # ~1.1 M characters
        Message("assistant", "here is everything " * 60_000),
    ]
    cut = renderer.render(huge, max_tokens=257)
    assert len(cut.input_ids) == 257 and max(spy.lengths) <= 2 * 16 * 257
    whole = ChatRenderer(tokenizer).render(huge)
    assert cut.input_ids == whole.input_ids[:257] and cut.loss_mask == whole.loss_mask[:257]


# ---- blank replies ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("blank", ["", " ", "\n\n", " \t "])
def test_a_blank_reply_is_never_supervised_and_a_row_of_only_blank_replies_is_an_empty_reply(tok, blank):
    """One rule with `generate` (which keeps no empty generated reply): a blank reply is unsupervised context; a
    row whose replies are all blank is rejected as `empty reply`, the reason generate records."""
    from peagle_pipeline.data.chat import EMPTY_REPLY
    from peagle_pipeline.data.dialogue import REASON_EMPTY

    template, tokenizer = tok
    assert EMPTY_REPLY == REASON_EMPTY == "empty reply"
    conv = [
        Message("user", "Hi"),
        Message("assistant", blank),
        Message("user", "Again?"),
        Message("assistant", "Yes"),
    ]
    sample = ChatRenderer(tokenizer).render(conv)
    assert masked_spans(tokenizer, sample) == [expected_reply(template, "Yes")]
    for renderer in (ChatRenderer(tokenizer), ChatRenderer(tokenizer, assistant_turns="last")):
        with pytest.raises(RejectRow, match=EMPTY_REPLY):
            renderer.render([Message("user", "Hi"), Message("assistant", blank)])
    with pytest.raises(RejectRow, match=EMPTY_REPLY):  # "last": the last reply is the one that counts
        ChatRenderer(tokenizer, assistant_turns="last").render([*conv[:3], Message("assistant", blank)])


# ---- reasoning kept apart from the content (reasoning_content / reasoning / thinking) ----
def _reasoning_row(key: str) -> list[Message] | None:
    from peagle_pipeline.data.records import to_conversation

    row = {
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!", key: "The user greets me."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris.", key: "France's capital is Paris."},
        ]
    }
    return to_conversation(row, "x.jsonl", 0).messages


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_apart_from_the_content_reaches_the_template_and_is_supervised(qwen3_tok, tmp_path, key):
    """A row that keeps its replies' reasoning in a field of its own is rendered with it where the template puts
    it (Qwen3: a <think> block on the newest reply, none on earlier ones; gpt-oss: the analysis channel of the last
    reply), supervised with the reply; before, the reasoning was silently left out."""
    from tiny import build_harmony_tokenizer

    conv = _reasoning_row(key)
    sample = ChatRenderer(qwen3_tok).render(conv)
    assert masked_spans(qwen3_tok, sample) == [
        "Hello!<|im_end|>",
        "<think>\nFrance's capital is Paris.\n</think>\n\nParis.<|im_end|>",
    ]
    harmony = build_harmony_tokenizer(tmp_path)
    spans = masked_spans(harmony, ChatRenderer(harmony).render(conv))
    assert spans == [
        "<|channel|>final<|message|>Hello!<|end|>",
        "<|channel|>analysis<|message|>France's capital is Paris.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Paris.<|return|>",
    ]


def test_reasoning_that_is_not_text_rejects_the_row():
    from peagle_pipeline.data.records import Reject, to_conversation

    row = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": 3}]
    }
    got = to_conversation(row, "x.jsonl", 5)
    assert isinstance(got, Reject) and got.reason == "reasoning of turn 1 is not a UTF-8 string"


def test_the_template_gets_the_renderers_clock_not_the_wall_clock(tmp_path):
    """gpt-oss's template writes "Current date" from `strftime_now`: a renderer answers it with its own time (fixed
    when made, or given), so every rendering of a conversation carries one date, past midnight too."""
    from datetime import datetime

    from tiny import build_harmony_tokenizer

    harmony = build_harmony_tokenizer(tmp_path)
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    pinned = ChatRenderer(harmony, now=datetime(2001, 2, 3, 23, 59, 59))
    assert "Current date: 2001-02-03\n" in pinned.render_text(conv, generation_prompt=False)
    made = ChatRenderer(harmony)
    assert f"Current date: {made.now:%Y-%m-%d}\n" in made.render_text(conv[:1], generation_prompt=True)


def test_template_variables_the_template_never_reads_are_refused(tmp_path):
    """A misspelt variable, or one a template has no use for, would render as if none were given."""
    qwen3 = build_qwen3_tokenizer(tmp_path / "qwen3")
    with pytest.raises(BadInput) as info:
        ChatRenderer(qwen3, template_kwargs={"enable_thinkng": False})
    message = str(info.value)
    assert "\n" not in message and message.startswith("chat_template_kwargs: enable_thinkng is never read")
    assert "it reads: " in message and "enable_thinking" in message.split("it reads: ")[1]
    assert ChatRenderer(qwen3, template_kwargs={"enable_thinking": False}).template_kwargs == {
        "enable_thinking": False
    }
    chatml = build_tokenizer(tmp_path / "chatml", "chatml")  # as SmolLM2's: no thinking mode
    with pytest.raises(BadInput, match="enable_thinking is never read .*it reads no variable of its own"):
        ChatRenderer(chatml, template_kwargs={"enable_thinking": False})
    assert ChatRenderer(chatml).template_kwargs == {}
