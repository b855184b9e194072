"""data.dialogue: multi-turn prompts grow by token ids, with the template's text between replies and nothing twice."""

from __future__ import annotations

import pytest
from tiny import build_harmony_tokenizer, build_qwen3_tokenizer, build_tokenizer

from peagle_pipeline.data.chat import ChatRenderer, RejectRow
from peagle_pipeline.data.dialogue import (
    REASON_EMPTY,
    REASON_LENGTH,
    REASON_NO_ANSWER,
    REASON_NOT_PREFIX_STABLE,
    REASON_REWRITES_REPLY,
    DialogueBuilder,
    template_end_of_turn_ids,
)
from peagle_pipeline.data.records import Conversation, Message, TokenizedConversation

END = {"chatml": "<|im_end|>", "chatml_system": "<|im_end|>", "llama3": "<|eot_id|>"}
CONV = Conversation(
    "data.jsonl",
    7,
    [
        Message("system", "Be brief."),
        Message("user", "Hi there"),
        Message("assistant", "ORIGINAL ONE"),
        Message("user", "What is the capital of France?"),
        Message("assistant", "ORIGINAL TWO"),
        Message("user", "Thanks"),
        Message("assistant", "ORIGINAL THREE"),
    ],
)
REPLIES = ["Hello! How are you?", "Paris is the capital.", "You are welcome."]


@pytest.fixture(scope="module", params=["chatml", "llama3", "chatml_system"])
def tok(request, tmp_path_factory):
    return request.param, build_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


def _builder(tokenizer, turns="all", template=None):
    renderer = ChatRenderer(tokenizer)
    return DialogueBuilder(renderer, turns, template_end_of_turn_ids(renderer) + [tokenizer.eos_token_id])


def _reply(tokenizer, text: str, end: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(end)]


def test_end_of_turn_token_of_each_template(tok):
    name, tokenizer = tok
    assert template_end_of_turn_ids(ChatRenderer(tokenizer)) == [tokenizer.convert_tokens_to_ids(END[name])]


def test_ids_equal_the_template_rendering_when_replies_are_its_own_tokens(tok):
    """Replies whose ids are the template's tokens give exactly the template's token sequence, mask on replies."""
    name, tokenizer = tok
    b = _builder(tokenizer)
    d = b.start(CONV, index=3)
    for text in REPLIES:
        assert d.active
        b.add_reply(d, _reply(tokenizer, text, END[name]), "stop")
    assert not d.active and d.ended is None and d.finish == ["stop"] * 3
    row = d.to_row()
    generated = [{"role": m.role, "content": m.content} for m in CONV.messages]
    for slot, text in zip((2, 4, 6), REPLIES, strict=True):
        generated[slot]["content"] = text
    assert row["messages"] == generated
    full = ChatRenderer(tokenizer).render([Message(m["role"], m["content"]) for m in generated])
    n = len(row["input_ids"])
    assert row["input_ids"] == full.input_ids[:n]  # only the separator after the last end-of-turn is left out
    assert row["loss_mask"] == [int(m) for m in full.loss_mask[:n]]
    assert not any(full.loss_mask[n:])


def test_later_prompts_hold_the_generated_replies_not_the_originals(tok):
    name, tokenizer = tok
    b = _builder(tokenizer)
    d = b.start(CONV, index=0)
    first = _reply(tokenizer, "Speculative decoding drafts tokens", END[name])
    b.add_reply(d, first, "stop")
    prompt = tokenizer.decode(d.input_ids)
    assert "Speculative decoding drafts tokens" in prompt and "ORIGINAL" not in prompt
    assert prompt.count(END[name]) == 4  # system, user, the reply (its generated token, not twice), user
    assert "What is the capital of France?" in prompt
    assert d.input_ids[d.reply_end - len(first) : d.reply_end] == first
    assert d.loss_mask == [0] * (d.reply_end - len(first)) + [1] * len(first) + [0] * (
        len(d.input_ids) - d.reply_end
    )


def test_first_and_last(tok):
    name, tokenizer = tok
    first = _builder(tokenizer, "first")
    d = first.start(CONV, index=0)
    first.add_reply(d, _reply(tokenizer, "Hi!", END[name]), "stop")
    row = d.to_row()
    assert not d.active and [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][-1]["content"] == "Hi!" and row["finish"] == ["stop"]

    last = _builder(tokenizer, "last")
    d = last.start(CONV, index=0)
    reply = _reply(tokenizer, "Bye", END[name])
    last.add_reply(d, reply, "stop")
    row = d.to_row()
    assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] == [
        "ORIGINAL ONE",
        "ORIGINAL TWO",
        "Bye",
    ]
    assert sum(row["loss_mask"]) == len(reply) and row["loss_mask"][-len(reply) :] == [1] * len(reply)
    assert "ORIGINAL TWO" in tokenizer.decode(row["input_ids"])  # the original replies are the context


def test_empty_and_cut_replies_end_the_conversation(tok):
    name, tokenizer = tok
    b = _builder(tokenizer)
    eot = tokenizer.convert_tokens_to_ids(END[name])
    d = b.start(CONV, index=0)
    b.add_reply(d, [eot], "stop")
    assert d.ended == REASON_EMPTY and d.turn == 0 and not d.active
    with pytest.raises(ValueError):
        d.to_row()

    d = b.start(CONV, index=0)
    cut = tokenizer("Paris is", add_special_tokens=False)["input_ids"]
    b.add_reply(d, cut, "length")
    assert d.ended == REASON_LENGTH and d.dropped_turns == 2
    row = d.to_row()
    assert row["input_ids"][-len(cut) :] == cut and row["finish"] == ["length"]
    assert len(row["input_ids"]) == d.reply_end


def test_a_template_that_rewrites_earlier_turns_ends_the_conversation(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ '<|im_start|>assistant\n(hidden)<|im_end|>\n' }}{% else %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    b = _builder(tokenizer)
    d = b.start(CONV, index=0)
    reply = _reply(tokenizer, "Hello", "<|im_end|>")
    b.add_reply(d, reply, "stop")
    assert d.ended == REASON_REWRITES_REPLY  # its earlier reply is written as "(hidden)", not as generated
    row = d.to_row()
    assert row["finish"] == ["stop"] and row["input_ids"][-len(reply) :] == reply


def test_a_template_whose_earlier_text_changes_is_not_prefix_stable(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")
    tokenizer.chat_template = (  # the header counts the messages: the text before the reply changes every turn
        "{{ '<|im_start|>system\n' + (messages|length|string) + '<|im_end|>\n' }}{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    b = _builder(tokenizer)
    d = b.start(CONV, index=0)
    b.add_reply(d, _reply(tokenizer, "Hello", "<|im_end|>"), "stop")
    assert d.ended == REASON_NOT_PREFIX_STABLE and d.turn == 1


def test_another_stop_token_gives_way_to_the_templates_end_of_turn(tmp_path):
    """A reply that stopped on an eos other than the template's end-of-turn is, as an earlier turn, what the
    template writes: its text closed by the template's token (supervised, as the stop token was), the eos left out."""
    tokenizer = build_tokenizer(tmp_path, "chatml")
    eos = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    b = DialogueBuilder(ChatRenderer(tokenizer), "all", [tokenizer.convert_tokens_to_ids("<|im_end|>"), eos])
    d = b.start(CONV, index=0)
    start = len(d.input_ids)
    hello = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    b.add_reply(d, hello + [eos], "stop")
    assert d.input_ids[start : d.reply_end] == hello + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert d.loss_mask[start : d.reply_end] == [1] * (len(hello) + 1) and not any(d.loss_mask[d.reply_end :])
    assert tokenizer.decode(d.input_ids[d.reply_end :]).startswith("\n<|im_start|>user\nWhat is")


def test_rows_without_a_user_turn_are_rejected(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")
    b = _builder(tokenizer)
    with pytest.raises(RejectRow, match="no user turn"):
        b.start(Conversation("x", 0, [Message("assistant", "hi")]), index=0)
    with pytest.raises(RejectRow, match="no assistant turn after"):
        b.start(Conversation("x", 0, [Message("user", "q"), Message("system", "s")]), index=0)


def test_rows_of_token_ids_are_rejected_not_a_crash(tmp_path):
    """`generate --data` given token ids (its own output, say) has no messages to prompt with: a reject reason."""
    b = _builder(build_tokenizer(tmp_path, "chatml"))
    with pytest.raises(RejectRow, match="token ids, not chat messages"):
        b.start(TokenizedConversation("x", 0, [1, 2, 3], [False, True, True]), index=0)


def test_a_prompt_without_a_reply_gets_its_reply_slot(tmp_path):
    """A conversation that ends with a user turn and has no reply after its first user turn is a prompt: the reply
    to generate is appended, prompted exactly as the template renders the conversation with a generation prompt."""
    tokenizer = build_tokenizer(tmp_path, "chatml")
    renderer = ChatRenderer(tokenizer)
    b = DialogueBuilder(renderer, "all", [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    for turns in (
        [Message("user", "q")],
        [Message("system", "s"), Message("user", "q")],
        [Message("assistant", "hi"), Message("user", "q")],
    ):
        d = b.start(Conversation("x", 0, turns), index=0)
        msgs = [{"role": m.role, "content": m.content} for m in turns]
        assert d.slots == [len(turns)] and d.messages[:-1] == msgs
        assert d.text == renderer.render_text(msgs, generation_prompt=True)
        b.add_reply(d, tokenizer("Sure", add_special_tokens=False)["input_ids"], "length")
        assert d.messages[-1] == {"role": "assistant", "content": "Sure"} and d.turn == 1


# ---- Qwen3's template (empty <think> on the newest turn, earlier replies without thinking) ----
QWEN3_REPLIES = [
    "<think>\nThe user greets me.\n</think>\n\nHello! How are you?",
    "Paris is the capital.",  # a reply without thinking (what a random tiny model writes)
    "<think>\nok\n</think>\n\nYou are welcome.",
]


@pytest.fixture(scope="module")
def qwen3_tok(tmp_path_factory):
    return build_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tok"))


def _qwen3_dialogue(tokenizer, thinking="strip"):
    renderer = ChatRenderer(tokenizer)
    b = DialogueBuilder(renderer, "all", template_end_of_turn_ids(renderer), thinking=thinking)
    d = b.start(CONV, index=0)
    generated = []
    for text in QWEN3_REPLIES:
        assert d.active, d.ended
        generated.append(_reply(tokenizer, text, "<|im_end|>"))
        b.add_reply(d, generated[-1], "stop")
    return d, generated


@pytest.mark.parametrize("thinking", ["strip", "keep"])  # Qwen3's template strips earlier thinking either way
def test_qwen3_multi_turn_rows_are_what_the_template_renders_with_the_generated_ids(qwen3_tok, thinking):
    d, generated = _qwen3_dialogue(qwen3_tok, thinking)
    assert d.ended is None and d.turn == 3
    row = d.to_row()
    # The row is the conversation as the server renders it when the last reply is the newest turn: earlier
    # replies without their thinking, the newest one whole (its reasoning in the <think> block).
    msgs = [{"role": m.role, "content": m.content} for m in CONV.messages]
    msgs[2]["content"], msgs[4]["content"], msgs[6]["content"] = "Hello! How are you?", *QWEN3_REPLIES[1:]
    rendered = qwen3_tok.apply_chat_template(msgs, tokenize=False)
    assert qwen3_tok.decode(row["input_ids"]) + "\n" == rendered
    assert row["input_ids"][-len(generated[2]) :] == generated[2]  # the newest reply: its generated ids
    answer = qwen3_tok("Hello! How are you?", add_special_tokens=False)["input_ids"]
    assert (
        generated[0][-len(answer) - 1 : -1] == answer
    )  # the earlier reply's ids are its generated answer ids
    spans, run = [], []
    for tid, m in zip(row["input_ids"], row["loss_mask"], strict=True):
        if m:
            run.append(tid)
        elif run:
            spans.append(qwen3_tok.decode(run))
            run = []
    spans.append(qwen3_tok.decode(run))
    assert spans == [
        "Hello! How are you?<|im_end|>",
        "Paris is the capital.<|im_end|>",
        "<think>\nok\n</think>\n\nYou are welcome.<|im_end|>",
    ]


def test_qwen3_without_thinking_drops_the_empty_block_of_an_earlier_turn(qwen3_tok):
    """enable_thinking false: each prompt ends with an empty thinking block, which Qwen3's template writes for the
    newest turn only; later prompts hold the earlier replies without it, and each row is the template's rendering
    of its conversation exactly, with the generated ids."""
    renderer = ChatRenderer(qwen3_tok, template_kwargs={"enable_thinking": False})
    b = DialogueBuilder(renderer, "all", template_end_of_turn_ids(renderer))
    d = b.start(CONV, index=0)
    assert d.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    generated = []
    for text in REPLIES:
        generated.append(_reply(qwen3_tok, text, "<|im_end|>"))
        b.add_reply(d, generated[-1], "stop")
        assert d.ended is None
    row = d.to_row()
    msgs = [{"role": m.role, "content": m.content} for m in CONV.messages]
    msgs[2]["content"], msgs[4]["content"], msgs[6]["content"] = REPLIES
    rendered = qwen3_tok.apply_chat_template(msgs, tokenize=False, enable_thinking=False)
    assert qwen3_tok.decode(row["input_ids"]) + "\n" == rendered
    assert _runs(qwen3_tok, row["input_ids"], row["loss_mask"]) == [t + "<|im_end|>" for t in REPLIES]
    for ids in generated:  # every reply's ids are in the row as generated
        assert any(row["input_ids"][i : i + len(ids)] == ids for i in range(len(row["input_ids"])))


def test_a_generation_prompt_that_opens_the_think_block(qwen3_tok):
    """Qwen3's Thinking-2507 models: the generation prompt ends "<think>\\n" and the model writes its reasoning, then
    "</think>"; an earlier reply is written without that opening, so it leaves the later prompts, and each row is
    the template's rendering with the generated ids."""
    import copy

    tok = copy.deepcopy(qwen3_tok)
    tok.chat_template = tok.chat_template.replace(
        "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
        "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking",
    )
    renderer = ChatRenderer(tok)
    b = DialogueBuilder(renderer, "all", template_end_of_turn_ids(renderer))
    d = b.start(CONV, index=0)
    assert d.text.endswith("<|im_start|>assistant\n<think>\n")
    replies = [f"Thinking {i}.\n</think>\n\n{text}" for i, text in enumerate(REPLIES)]
    for text in replies:
        b.add_reply(d, _reply(tok, text, "<|im_end|>"), "stop")
        assert d.ended is None
    row = d.to_row()
    msgs = [{"role": m.role, "content": m.content} for m in CONV.messages]
    msgs[2]["content"], msgs[4]["content"], msgs[6]["content"] = replies
    assert tok.decode(row["input_ids"]) + "\n" == tok.apply_chat_template(msgs, tokenize=False)
    assert _runs(tok, row["input_ids"], row["loss_mask"]) == [
        *(t + "<|im_end|>" for t in REPLIES[:2]),
        replies[2] + "<|im_end|>",
    ]


def test_qwen3_a_row_that_ends_early_keeps_its_newest_reply_as_generated(qwen3_tok):
    renderer = ChatRenderer(qwen3_tok)
    b = DialogueBuilder(renderer, "all", template_end_of_turn_ids(renderer))
    d = b.start(CONV, index=0)
    first = _reply(qwen3_tok, QWEN3_REPLIES[0], "<|im_end|>")
    b.add_reply(d, first, "stop")
    b.add_reply(d, _reply(qwen3_tok, "", "<|im_end|>"), "stop")  # an empty second reply ends it
    row = d.to_row()
    assert d.ended == REASON_EMPTY and row["input_ids"][-len(first) :] == first
    assert row["messages"][-1]["content"] == QWEN3_REPLIES[0]


def test_keep_gives_a_template_that_keeps_thinking_the_whole_reply(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "chatml")  # plain ChatML writes whatever content it is given
    renderer = ChatRenderer(tokenizer)
    for thinking, seen in (("keep", True), ("strip", False)):
        b = DialogueBuilder(renderer, "all", template_end_of_turn_ids(renderer), thinking=thinking)
        d = b.start(CONV, index=0)
        first = _reply(tokenizer, QWEN3_REPLIES[0], "<|im_end|>")
        b.add_reply(d, first, "stop")
        assert d.ended is None
        prompt = tokenizer.decode(d.input_ids)
        assert ("The user greets me." in prompt) is seen and "Hello! How are you?<|im_end|>" in prompt


def test_a_reply_is_kept_as_written_by_a_tokenizer_that_cleans_up_spaces(tmp_path):
    """A tokenizer whose decode strips the space before punctuation (`clean_up_tokenization_spaces`, Llama 3's
    setting; transformers before 5 applies it to BPE tokenizers too) must not change a generated reply's text."""
    tokenizer = build_tokenizer(tmp_path, "chatml")
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = (
        True  # transformers >= 5
    )
    text = "Yes , it is . Is n't it ?"
    assert (
        tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) != text
    )  # it does clean up
    b = _builder(tokenizer)
    d = b.start(CONV, index=0)
    b.add_reply(d, _reply(tokenizer, text, END["chatml"]), "stop")
    assert d.active and d.messages[2]["content"] == text


# ---- gpt-oss's harmony template: analysis and final channels, earlier replies closed by <|end|> ----
HARMONY_REPLIES = [
    "<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
    "<|channel|>final<|message|>Paris is the capital.",  # no analysis (reasoning effort low)
    "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>You are welcome.",
]
HARMONY_ANSWERS = ["Hello!", "Paris is the capital.", "You are welcome."]


@pytest.fixture(scope="module")
def harmony_tok(tmp_path_factory):
    return build_harmony_tokenizer(tmp_path_factory.mktemp("harmony-tok"))


def _runs(tokenizer, ids, mask) -> list[str]:
    """The supervised runs of a row, decoded."""
    spans, run = [], []
    for tid, m in [*zip(ids, mask, strict=True), (None, 0)]:
        if m:
            run.append(tid)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


@pytest.mark.parametrize(
    "thinking", ["strip", "keep"]
)  # the template drops an earlier reply's analysis either way
def test_harmony_multi_turn_rows_are_what_the_template_renders_with_the_generated_ids(harmony_tok, thinking):
    """Each later prompt holds the earlier replies as the template writes them (final channel only, closed by
    <|end|>), with the generated ids of the final channel; the newest reply is whole, closed by <|return|>."""
    renderer = ChatRenderer(harmony_tok)
    stops = template_end_of_turn_ids(renderer)
    assert harmony_tok.convert_ids_to_tokens(stops) == ["<|return|>"]
    b = DialogueBuilder(renderer, "all", stops, thinking=thinking)
    d = b.start(CONV, index=0)
    first_reply_at = len(d.input_ids)
    generated = []
    for text in HARMONY_REPLIES:
        assert d.active, d.ended
        generated.append(_reply(harmony_tok, text, "<|return|>"))
        b.add_reply(d, generated[-1], "stop")
    assert d.ended is None and d.turn == 3
    row = d.to_row()
    msgs = [{"role": m.role, "content": m.content} for m in CONV.messages[:-1]]
    msgs[2]["content"], msgs[4]["content"] = HARMONY_ANSWERS[:2]
    prompt = harmony_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert harmony_tok.decode(row["input_ids"]) == prompt + HARMONY_REPLIES[2] + "<|return|>"
    assert row["input_ids"][-len(generated[2]) :] == generated[2]
    assert _runs(harmony_tok, row["input_ids"], row["loss_mask"]) == [
        "<|channel|>final<|message|>Hello!<|end|>",
        "<|channel|>final<|message|>Paris is the capital.<|end|>",
        HARMONY_REPLIES[2] + "<|return|>",
    ]
    # The earlier reply is its generated final-channel ids (not re-tokenised text), then the template's <|end|>.
    final = generated[0][generated[0].index(harmony_tok.convert_tokens_to_ids("<|channel|>"), 1) : -1]
    assert row["input_ids"][first_reply_at : first_reply_at + len(final) + 1] == [
        *final,
        harmony_tok.convert_tokens_to_ids("<|end|>"),
    ]


def test_harmony_reply_without_a_final_channel_ends_the_conversation(harmony_tok):
    """A reply that never reached the final channel (a tool call on <|call|>, say) cannot be an earlier turn of a
    plain chat: the conversation ends there with a reason, the reply kept as generated."""
    renderer = ChatRenderer(harmony_tok)
    call = harmony_tok.convert_tokens_to_ids("<|call|>")
    b = DialogueBuilder(renderer, "all", [*template_end_of_turn_ids(renderer), call])
    d = b.start(CONV, index=0)
    reply = _reply(harmony_tok, "<|channel|>analysis<|message|>I should look it up.<|end|>", "<|call|>")
    b.add_reply(d, reply, "stop")
    assert not d.active and d.ended == REASON_NO_ANSWER and d.turn == 1
    assert d.to_row()["input_ids"][-len(reply) :] == reply
