"""The rule that picks the default prompt layout (kvrag.eval.layout_report), on made-up records: the template
bounds turn two, and the held-out half can veto a pick but never rank."""

from kvrag.eval.layout_report import choose, decide, summarise


def rows(set_name, layout, method, half, hits, n, turn=0):
    return [{"set": set_name, "row": f"{half}{i}", "half": half, "layout": layout, "method": method, "turn": turn,
             "contains": float(i < hits), "agree": 1.0} for i in range(n)]


def records(table):
    """table: (set, turn) -> layout -> (choose hits, report hits), 4 rows a half; every layout under both methods."""
    out = []
    for (set_name, turn), cells in table.items():
        for layout, (choose_hits, report_hits) in cells.items():
            methods = ("full",) if layout == "template" else ("full", "default")
            for method in methods:
                out += rows(set_name, layout, method, "choose", choose_hits, 4, turn)
                out += rows(set_name, layout, method, "report", report_hits, 4, turn)
    return out


def test_a_layout_behind_the_template_on_turn_two_does_not_pass():
    table = {("facts", 0): {"v1": (1, 1), "a": (4, 4), "b": (3, 3)},
             ("conversations", 1): {"v1": (1, 1), "a": (4, 4), "b": (3, 3), "template": (3, 3)},
             ("conversations", 2): {"v1": (1, 1), "a": (1, 1), "b": (3, 3), "template": (3, 3)}}
    verdict = decide(summarise(records(table)))
    assert not verdict["verdicts"]["a"]["passes"] and "the template's" in verdict["verdicts"]["a"]["worse"][0]
    assert verdict["chosen"] == "b"


def test_a_pick_that_does_not_hold_on_the_held_out_half_is_set_aside_for_the_next():
    table = {("facts", 0): {"v1": (2, 2), "a": (4, 0), "b": (3, 3)},
             ("sample", 0): {"v1": (2, 2), "a": (4, 4), "b": (3, 3)}}
    choice, check, aside = choose(summarise(records(table)))
    assert choice["ranked"] == ["a", "b"]  # ranked on the choose half only
    assert [a["chosen"] for a in aside] == ["a"] and "today's" in aside[0]["worse"][0]
    assert choice["chosen"] == "b" and check["holds"]


def test_with_no_pick_holding_today_stays():
    table = {("facts", 0): {"v1": (2, 2), "a": (4, 0)}}
    choice, check, aside = choose(summarise(records(table)))
    assert choice["chosen"] == "v1" and [a["chosen"] for a in aside] == ["a"]


def test_the_index_set_retrieves_each_turn_from_every_document():
    """`conversations-index`: turn one retrieves with its question, turn two with the user turns so far, from one
    index of all the documents; each finds three, and the conversation's own document is among them."""
    import json
    from importlib import resources

    from kvrag.eval.layout_eval import INDEX_TOP_K, load_index_conversations

    spec = json.loads(resources.files("kvrag.eval").joinpath("layout_conversations.json").read_text(encoding="utf-8"))
    gold = {c["id"]: f"layout-doc-{c['doc']}" for c in spec["conversations"]}
    cases = load_index_conversations()
    assert len(cases) == len(spec["conversations"]) and all(len(c.chunks_for(t)) == INDEX_TOP_K for c in cases for t in (1, 2))
    found = [gold[c.id] in {x.id for x in c.chunks_for(t)} for c in cases for t in (1, 2)]
    assert sum(found) >= 0.9 * len(found)
    assert any([x.id for x in c.chunks_for(1)] != [x.id for x in c.chunks_for(2)] for c in cases)  # turn two retrieves anew
