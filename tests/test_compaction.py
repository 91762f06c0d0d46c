"""The compaction policy on token lists: when to compact, where to cut (whole turns kept,
a call never parted from its result, the user message of a turn cut inside kept in front),
how pieces and cut tool results are made."""

from __future__ import annotations

import random

from lucedesk.agent.compaction import Cut, Policy, cut_text, pieces, plan

POLICY = Policy(compact_at=0.8, recent=0.3, tool_result=0.2, summary_tokens=1024)


def test_over_the_threshold_only():
    assert not POLICY.over(800, 1000)
    assert POLICY.over(801, 1000)


def test_the_newest_whole_turns_that_fit_are_kept():
    roles = ["user", "assistant"] * 6
    counts = [60, 90] * 6  # a turn: 150 tokens; 300 fit in 0.3 of 1000
    assert plan(roles, counts, 1000, POLICY) == Cut(8)


def test_a_turn_too_large_is_cut_between_steps_its_question_kept_in_front():
    roles = ["user", "assistant", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    counts = [50, 50, 40, 30, 150, 30, 150, 40]
    cut = plan(roles, counts, 1000, POLICY)
    # [5:] is 220 tokens, plus the question's 40: within 300; [3:] would be 400
    assert cut == Cut(5, pinned=2)


def test_a_call_is_never_parted_from_its_result():
    rng = random.Random(7)
    made = 0
    for _ in range(300):
        roles = ["user"]
        while len(roles) < rng.randint(2, 30):
            roles.append(rng.choice(["user", "assistant", "assistant", "tool"]))
        counts = [rng.randint(1, 400) for _ in roles]
        cut = plan(roles, counts, rng.choice([512, 1024, 8192]), POLICY)
        if cut is None:  # nothing to cut, or too little to be worth a summary
            continue
        made += 1
        assert 1 <= cut.keep < len(roles)
        assert roles[cut.keep] != "tool"
        if roles[cut.keep] == "user":
            assert cut.pinned is None
        else:
            assert cut.pinned is not None and roles[cut.pinned] == "user"
            assert cut.pinned < cut.keep
    assert made > 100


def test_tool_results_count_as_cut_when_choosing():
    roles = ["user", "assistant", "user", "assistant", "tool", "assistant"]
    counts = [100, 100, 20, 20, 5000, 20]  # the result is cut to 200 in the view
    assert plan(roles, counts, 1000, POLICY) == Cut(2)


def test_nothing_to_cut():
    assert plan(["user"], [5000], 1000, POLICY) is None
    assert plan(["user", "tool"], [10, 5000], 1000, POLICY) is None
    # one call and its results: the cut would summarize nothing but the pinned question
    roles = ["user", "assistant", "tool", "tool", "tool"]
    assert plan(roles, [300, 100, 400, 400, 400], 1000, POLICY) is None


def test_no_cut_that_summarizes_less_than_a_summary():
    roles = ["user", "assistant", "user", "assistant"]
    assert plan(roles, [60, 60, 150, 100], 1000, POLICY) is None  # 120 <= 125
    assert plan(roles, [70, 70, 150, 100], 1000, POLICY) == Cut(2)


def test_budgets_follow_the_context():
    assert POLICY.summary_budget(1024) == 128
    assert POLICY.summary_budget(65536) == 1024
    assert POLICY.tool_budget(1000) == 200
    # a 1,024-token context with 100 tokens of system prompt takes a message of 732
    assert POLICY.message_room(100, 1024) == 1024 - 100 - 128 - 64


def test_pieces_cover_the_text_at_line_ends():
    text = "".join(f"line {i} " + "x" * (i % 13) + "\n" for i in range(500))
    parts = pieces(text, tokens=4000, budget=500)
    assert "".join(parts) == text
    assert 8 <= len(parts) <= 10
    assert all(p.endswith("\n") for p in parts)
    assert pieces("short", 3, 500) == ["short"]


def test_a_cut_tool_result_says_what_was_cut():
    text = "\n".join(f"row {i}" for i in range(2000))
    out = cut_text(text, tokens=8000, budget=400)
    assert out.startswith("row 0\nrow 1\n")
    assert "this result had 8,000 tokens, the first 376 are shown" in out
    assert len(out) < len(text) / 10
    assert cut_text("small", 2, 400) == "small"
