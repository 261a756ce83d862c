"""Fictional-fact question sets: the answer is only in the documents, never in a model's pretraining.

Entities (towns, people, companies, rivers, ships, festivals, inventions, mountains, schools) are built
from seeded random syllables, so no pretrained model knows their facts; each row asks one fact and holds
the entity's document among same-type distractors. Rows use the shared evaluation format
(`kvrag.eval.data.load_examples` reads them).

Seeds: the entities depend on `seed` only (never on `phrasings`), so keep training and evaluation
apart by seed — by convention training uses seeds 0-99 and evaluation seeds >= 1000 — and by phrasing
group: `phrasings="train"` for training, `"heldout"` for evaluation (question wordings training never
saw). Nothing is refused; the convention is the caller's to keep. No gazetteer is checked: names are
syllable combinations chosen to look unfamiliar, and a rare one may happen to match a real place.

    python -m kvrag.eval.synthetic --n 30 --seed 1000 --style short --docs 3 --phrasings heldout --out facts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

STYLES = ("short", "one", "long")
PHRASINGS = ("train", "heldout", "all", "calibration")
# Row i asks a fact of kind KINDS[i % len(KINDS)], so every kind is equally represented.
KINDS = ("year", "number", "person", "place", "list", "thing")

# Question wordings per fact kind, split so evaluation can use wordings training never saw. The two
# groups share no template, within a kind or across kinds.
QUESTION_TEMPLATES: dict[str, dict[str, list[str]]] = {
    "year": {
        "train": ["In which year was {x} {verb}?", "When was {x} {verb}?", "{X} was {verb} in what year?"],
        "heldout": ["What year was {x} {verb} in?", "In what year was {x} {verb}?", "What is the year in which {x} was {verb}?"],
        "calibration": ["Tell me the year in which {x} was {verb}.", "According to the documents, when was {x} {verb}?"],
    },
    "number": {
        "train": ["What is the {attr} of {x}?", "{how}", "{X} has what {attr}?"],
        "heldout": ["What is {x}'s {attr}?", "What {attr} does {x} have?", "Can you tell me the {attr} of {x}?"],
        "calibration": ["According to the documents, what is the {attr} of {x}?", "Give the {attr} of {x}."],
    },
    "person": {
        "train": ["Who was the {role} of {x}?", "Name the {role} of {x}.", "Which person was the {role} of {x}?"],
        "heldout": ["Who served as the {role} of {x}?", "The {role} of {x} was who?", "Do you know who the {role} of {x} was?"],
        "calibration": ["According to the documents, who was the {role} of {x}?", "Give the name of the {role} of {x}."],
    },
    "place": {
        "train": ["Where {be} {x} {verb}?", "In which {ptype} {be} {x} {verb}?", "{X} {be} {verb} where?"],
        "heldout": ["In what {ptype} {be} {x} {verb}?", "Which {ptype} {be} {x} {verb} in?",
                    "What is the name of the {ptype} where {x} {be} {verb}?"],
        "calibration": ["According to the documents, in which {ptype} {be} {x} {verb}?", "Give the {ptype} where {x} {be} {verb}."],
    },
    "list": {
        "train": ["What are the {items} {x}?", "List the {items} {x}.", "Name the three {items} {x}."],
        "heldout": ["Which are the {items} {x}?", "Can you name the {items} {x}?", "Tell me the {items} {x}."],
        "calibration": ["According to the documents, what are the {items} {x}?", "Give the {items} {x}."],
    },
    "thing": {
        "train": ["What is the {attr} of {x}?", "Name the {attr} of {x}.", "{X} has what {attr}?"],
        "heldout": ["What is {x}'s {attr}?", "What {attr} does {x} have?", "Can you tell me the {attr} of {x}?"],
        "calibration": ["Name the {attr} of {x}, as the documents give it.", "Give the {attr} of {x}, as the documents say."],
    },
}

# Sentences that state a fact in a document ({v} is the value exactly as the answer gives it).
DOC_TEMPLATES: dict[str, list[str]] = {
    "year": ["{X} was {verb} in {v}.", "In {v}, {x} was {verb}.", "It was in {v} that {x} was {verb}."],
    "number": ["{X} {state}.", "The {attr} of {x} is {v}.", "Records give the {attr} of {x} as {v}."],
    "person": ["The {role} of {x} was {v}.", "{V} was the {role} of {x}.",
               "According to local records, the {role} of {x} was {v}."],
    "place": ["{X} {be} {verb} in the {ptype} of {v}.", "The {ptype} of {v} is where {x} {be} {verb}."],
    "list": ["The {items} {x} are {v}.", "As for the {items} {x}, they are {v}."],
    "thing": ["{X} {state}.", "The {attr} of {x} is {v}."],
}

# Sentences with no fact in them, padding "long" documents.
FILLER = [
    "{X} is mentioned in several local guidebooks.", "Visitors often remark on the quiet character of {x}.",
    "Older archives say little else about {x}.", "Accounts of {x} differ on a few minor details.",
    "{X} appears in a number of regional stories.", "Many people in the area have heard of {x}.",
    "A short pamphlet about {x} is kept in the district library.", "Historians still argue about parts of the story of {x}.",
    "Old photographs of {x} hang in a nearby inn.", "{X} is sometimes confused with others of a similar name.",
]

_START = ["bra", "cor", "dal", "ery", "fen", "gar", "hol", "isk", "jor", "kel", "lum", "mar", "nor", "osk", "pel",
          "quar", "ros", "sil", "tar", "ulv", "vel", "wen", "yar", "zan", "bryn", "cath", "drom", "eld", "fal", "grem"]
_MID = ["a", "e", "i", "o", "an", "el", "or", "ith", "ar", "en"]
_END = ["noch", "vie", "wen", "mar", "dra", "sk", "tal", "rin", "vok", "ssa", "mere", "holt", "dun", "lis", "bek",
        "gard", "ven", "ost", "warr", "ceth"]
_FIRST_END = ["ivra", "ello", "ethe", "ysse", "orin", "anwe", "idda", "ulka", "emund", "aric"]
_REGION_END = ["avia", "ennia", "orra", "uthia", "esk"]
_ORG_KIND = ["Holdings", "Trust", "Guild", "Society", "Group"]
COLOURS = ["red", "white", "green", "blue", "yellow", "black", "purple", "grey", "gold", "brown"]
STONES = ["sandstone", "granite", "brick", "timber", "limestone", "slate", "marble", "basalt"]


def _word(rng: random.Random) -> str:
    return (rng.choice(_START) + rng.choice(_MID) + rng.choice(_END)).capitalize()


def _person(rng: random.Random) -> tuple[str, str]:
    """(full name, surname): both are accepted answers."""
    surname = _word(rng)
    return f"{(rng.choice(_START) + rng.choice(_FIRST_END)).capitalize()} {surname}", surname


def _org(rng: random.Random) -> str:
    return f"{_word(rng)} {rng.choice(_ORG_KIND)}"


def _named(fmt: str, ref: str = "{}", pick: list[str] | None = None) -> Callable[[random.Random], tuple[str, str]]:
    """An entity-name maker: (title, how sentences refer to it, e.g. with "the")."""
    def make(rng: random.Random) -> tuple[str, str]:
        name = fmt.format(w=_word(rng), p=rng.choice(pick or [""]))
        return name, ref.format(name)
    return make


def _number(attr: str, unit: str, how: str, state: str, lo: int, hi: int) -> dict[str, Any]:
    return {"attr": attr, "unit": unit, "how": how, "state": state, "range": (lo, hi)}


def _place(be: str, verb: str, ptype: str) -> dict[str, Any]:
    return {"be": be, "verb": verb, "ptype": ptype}


# Entity types: a name maker and one fact per kind (a person has no number fact).
TYPES: dict[str, dict[str, Any]] = {
    "town": {"name": _named("{w}"), "facts": {
        "year": {"verb": "founded", "range": (1150, 1890)},
        "number": _number("population", "inhabitants", "How many people live in {x}?", "has {v}", 800, 90000),
        "person": {"role": "first mayor"}, "place": _place("is", "located", "region"),
        "list": {"items": "colours of the flag of", "pool": COLOURS},
        "thing": {"attr": "main building material", "state": "is built mostly of {v}", "pool": STONES}}},
    "person": {"name": lambda rng: (_person(rng)[0],) * 2, "facts": {
        "year": {"verb": "born", "range": (1780, 1990)}, "person": {"role": "mentor"},
        "place": _place("was", "born", "town"),
        "list": {"items": "instruments played by", "pool": "violin harp flute cello drums lute oboe organ".split()},
        "thing": {"attr": "employer", "state": "worked for {v}", "org": True}}},
    "company": {"name": _named("{w} {p}", pick=["Works", "Instruments", "Trading House", "Mills", "Foundry"]), "facts": {
        "year": {"verb": "founded", "range": (1780, 1995)},
        "number": _number("number of employees", "people", "How many people work for {x}?", "employs {v}", 40, 9000),
        "person": {"role": "founder"}, "place": _place("is", "based", "town"),
        "list": {"items": "main products of", "pool": "looms lamps clocks barrels saddles kettles ropes pencils".split()},
        "thing": {"attr": "parent company", "state": "is owned by {v}", "org": True}}},
    "river": {"name": _named("{w} River", "the {}"), "facts": {
        "year": {"verb": "first mapped", "range": (1500, 1900)},
        "number": _number("length", "km", "How long is {x}?", "is {v} long", 12, 900),
        "person": {"role": "first explorer"}, "place": _place("is", "located", "region"),
        "list": {"items": "fish found in", "pool": "trout pike perch eel carp salmon bream roach".split()},
        "thing": {"attr": "water colour", "state": "has {v} water", "pool": COLOURS}}},
    "ship": {"name": _named("{w}", "the {}"), "facts": {
        "year": {"verb": "launched", "range": (1650, 1960)},
        "number": _number("length", "metres", "How long is {x}?", "is {v} long", 20, 140),
        "person": {"role": "captain"}, "place": _place("was", "built", "port"),
        "list": {"items": "cargoes carried by", "pool": "wool timber salt coal grain tea copper cotton".split()},
        "thing": {"attr": "hull colour", "state": "is painted {v}", "pool": COLOURS}}},
    "festival": {"name": _named("{w} {p} Festival", "the {}", pick=["Lantern", "Harvest", "Kite", "Fiddle", "Salt"]), "facts": {
        "year": {"verb": "first held", "range": (1600, 1990)},
        "number": _number("number of visitors", "visitors", "How many visitors does {x} attract?", "attracts {v} each year", 500, 60000),
        "person": {"role": "founder"}, "place": _place("is", "held", "town"),
        "list": {"items": "ingredients of the traditional dish of", "pool": "barley honey leeks lentils plums walnuts cabbage fennel".split()},
        "thing": {"attr": "organiser", "state": "is organised by {v}", "org": True}}},
    "invention": {"name": _named("{w} {p}", "the {}", pick=["loom", "engine", "press", "compass", "lamp", "pump"]), "facts": {
        "year": {"verb": "invented", "range": (1600, 1980)},
        "number": _number("weight", "kilograms", "How heavy is {x}?", "weighs {v}", 2, 300),
        "person": {"role": "inventor"}, "place": _place("was", "invented", "town"),
        "list": {"items": "main parts of", "pool": "crank spring lens bellows wheel valve lever drum".split()},
        "thing": {"attr": "main material", "state": "is made mainly of {v}", "pool": "brass oak copper iron steel glass bronze pewter".split()}}},
    "mountain": {"name": _named("Mount {w}"), "facts": {
        "year": {"verb": "first climbed", "range": (1750, 1970)},
        "number": _number("height", "metres", "How high is {x}?", "is {v} high", 800, 4800),
        "person": {"role": "first climber"}, "place": _place("is", "located", "region"),
        "list": {"items": "animals found on", "pool": "ibex marmots eagles hares foxes ravens lynx chamois".split()},
        "thing": {"attr": "main type of rock", "state": "consists mostly of {v}", "pool": "granite basalt limestone schist gneiss slate".split()}}},
    "school": {"name": _named("{w} {p}", pick=["Academy", "College", "Grammar School"]), "facts": {
        "year": {"verb": "founded", "range": (1400, 1980)},
        "number": _number("number of pupils", "pupils", "How many pupils attend {x}?", "has {v}", 80, 1800),
        "person": {"role": "first head teacher"}, "place": _place("is", "located", "town"),
        "list": {"items": "main subjects taught at", "pool": "music chemistry carpentry astronomy geography drawing rowing botany".split()},
        "thing": {"attr": "school colour", "state": "has {v} as its school colour", "pool": COLOURS}}},
}


def templates(kind: str, phrasings: str) -> list[str]:
    """The question templates of one fact kind in a phrasing group ("all" = train then heldout; "calibration":
    the calibration set's own, which no training or evaluation row uses)."""
    groups = QUESTION_TEMPLATES[kind]
    return groups["train"] + groups["heldout"] if phrasings == "all" else list(groups[phrasings])


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _value(kind: str, spec: dict[str, Any], rng: random.Random) -> tuple[str, list[str]]:
    """A fact's value as the document writes it, and the answers accepted for it (that text first)."""
    if kind == "year":
        year = str(rng.randint(*spec["range"]))
        return year, [year]
    if kind == "number":
        v = rng.randint(*spec["range"])
        return f"{v} {spec['unit']}", [f"{v} {spec['unit']}", str(v)]
    if kind == "person":
        full, surname = _person(rng)
        return full, [full, surname]
    if kind == "place":
        region = (rng.choice(_START) + rng.choice(_MID) + rng.choice(_REGION_END)).capitalize()
        name = region if spec["ptype"] == "region" else _word(rng)
        return name, [name]
    if kind == "list":
        a, b, c = rng.sample(spec["pool"], 3)
        return f"{a}, {b} and {c}", [f"{a}, {b} and {c}"]
    value = _org(rng) if spec.get("org") else rng.choice(spec["pool"])
    return value, [value]


def _entity(etype: str, rng: random.Random) -> dict[str, Any]:
    name, ref = TYPES[etype]["name"](rng)
    facts = {kind: (spec, *_value(kind, spec, rng)) for kind, spec in TYPES[etype]["facts"].items()}
    return {"type": etype, "name": name, "ref": ref, "facts": facts}


def _slots(ent: dict[str, Any], kind: str) -> dict[str, Any]:
    spec, value, _ = ent["facts"][kind]
    slots = {**spec, "x": ent["ref"], "X": _cap(ent["ref"]), "v": value, "V": _cap(value)}
    for key in ("state", "how"):
        if key in spec:
            slots[key] = spec[key].format(v=value, x=ent["ref"])
    return slots


def _document(ent: dict[str, Any], asked: str, style: str, rng: random.Random) -> str:
    """One sentence (style "one"), 2-5 fact sentences ("short"), or every fact plus filler to 6-10 ("long")."""
    others = [k for k in ent["facts"] if k != asked]
    if style == "short":
        others = rng.sample(others, rng.randint(1, min(4, len(others))))
    kinds = [asked] + (others if style != "one" else [])
    sentences = [_cap(rng.choice(DOC_TEMPLATES[k]).format(**_slots(ent, k))) for k in kinds]
    if style == "long":
        pad = rng.randint(max(6, len(sentences) + 1), 10) - len(sentences)
        sentences += [_cap(f.format(x=ent["ref"], X=_cap(ent["ref"]))) for f in rng.sample(FILLER, pad)]
    if style != "one":
        rng.shuffle(sentences)
    return " ".join(sentences)


def normalize(text: str) -> str:
    """SQuAD normalisation (as kvrag.eval.metrics, without importing torch): lower, no punctuation or articles."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _mentions(text: str, phrases: list[str]) -> bool:
    padded = f" {normalize(text)} "
    return any(f" {normalize(p)} " in padded for p in phrases if normalize(p))


def _row(i: int, seed: int, style: str, docs: int, phrasings: str) -> dict[str, Any]:
    kind = KINDS[i % len(KINDS)]
    rng = random.Random(f"kvrag.synthetic:{seed}:{i}")  # entities, documents, order: never the phrasing group
    etype = rng.choice([t for t in TYPES if kind in TYPES[t]["facts"]])
    gold = _entity(etype, rng)
    answers = gold["facts"][kind][2]
    ctxs = [{"title": gold["name"], "text": _document(gold, kind, style, rng)}]
    attempts = 0
    while len(ctxs) < docs:  # same-type distractors that neither state the answer nor name the gold entity
        attempts += 1
        if attempts > 100 * docs:
            raise RuntimeError(f"row {i}: could not draw {docs - 1} distractors")
        other = _entity(etype, rng)
        text = _document(other, kind, style, rng)
        if other["name"] not in [c["title"] for c in ctxs] and not _mentions(text, answers + [gold["name"]]):
            ctxs.append({"title": other["name"], "text": text})
    order = list(range(docs))
    rng.shuffle(order)
    qrng = random.Random(f"kvrag.synthetic:{seed}:{i}:question:{phrasings}")
    question = _cap(qrng.choice(templates(kind, phrasings)).format(**_slots(gold, kind)))
    return {"id": f"facts-{style}-{seed}-{i:04d}", "question": question, "answers": answers,
            "ctxs": [ctxs[j] for j in order], "gold_index": order.index(0),
            "source": f"kvrag.eval.synthetic style={style} seed={seed} phrasings={phrasings} docs={docs}"}


def rows(n: int, seed: int = 0, style: str = "short", docs: int = 3, phrasings: str = "all") -> list[dict[str, Any]]:
    """`n` fictional-fact rows; `docs` documents per row (the gold one + docs-1 distractors).

    Row i depends only on (seed, i, style, docs, phrasings), so a longer set extends a shorter one; the
    entities and documents do not depend on `phrasings`. Train on seeds 0-99, evaluate on seeds >= 1000.
    """
    if style not in STYLES or phrasings not in PHRASINGS or docs < 1 or n < 0:
        raise ValueError(f"need style in {STYLES}, phrasings in {PHRASINGS}, docs >= 1, n >= 0; "
                         f"got {style!r}, {phrasings!r}, {docs}, {n}")
    return [_row(i, seed, style, docs, phrasings) for i in range(n)]


# The calibration set (kvrag.check.calibrate; shipped as kvrag/check/calibration_set.json): its own seed (a
# word, never an integer training or evaluation seed) and phrasing group, contexts long enough to be reused.
CALIBRATION_KEY = "calibration"
CALIBRATION_SIZES = (("small", 5), ("large", 8))  # documents per context: ~900 and ~1,400 chunk tokens (SmolLM2)
CALIBRATION_GROUPS = 3  # contexts of each size (each is read whole once by Full Attention: the costly part); 72 questions,
# of which the bundled model answers about a third right with Full Attention: enough for the rule to rule on right answers
CALIBRATION_QUESTIONS = 12  # questions per context
CALIBRATION_EVENTS = 3  # event sentences per document besides its facts

# Event sentences: "<someone> <did> the <adjective> <thing> <near> <entity> <when>." Drawn word by word from
# pools, so two documents rarely share a phrase: the documents read as passages, not as records of one kind
# (kvrag.methods.alike), which every method would read whole.
_EVENT_VERBS = ("repaired painted sold bought carried described photographed guarded measured rebuilt cleaned moved found "
                "lost hid borrowed visited studied mapped sketched praised mocked ignored weighed counted traded decorated "
                "inspected polished recorded").split()
_EVENT_ADJS = ("rusty narrow crooked tiny enormous faded wooden copper forgotten famous broken hidden ancient crowded quiet "
               "muddy golden damp windy steep marble velvet humble noisy gilded").split()
_EVENT_NOUNS = ("bell bridge clock gate lantern ledger map tower garden chapel cellar statue fountain barn mill harbour "
                "orchard archive carriage well banner organ window staircase library").split()
_EVENT_PREPS = "near beside behind inside above below opposite outside".split()
_EVENT_WHEN = ("in {y}", "during {y}", "before {y}", "after {y}", "around {y}", "late in {y}", "early in {y}")


def _event(ent: dict[str, Any], rng: random.Random) -> str:
    return (f"{_person(rng)[0]} {rng.choice(_EVENT_VERBS)} the {rng.choice(_EVENT_ADJS)} {rng.choice(_EVENT_NOUNS)} "
            f"{rng.choice(_EVENT_PREPS)} {ent['ref']} {rng.choice(_EVENT_WHEN).format(y=rng.randint(1500, 1990))}.")


def mixed_group(key: str, docs: int, questions: int, phrasings: str = "calibration", events: int = CALIBRATION_EVENTS) -> dict[str, Any]:
    """One context of `docs` documents about entities of different types, each stating every fact of its
    entity among `events` event sentences (so the context is never records of one kind), and `questions`
    questions about its entities, the fact kinds taken in turn (a kind the entity lacks: the next one)."""
    rng = random.Random(f"kvrag.synthetic:{key}")
    etypes = list(TYPES)
    rng.shuffle(etypes)
    ents: list[dict[str, Any]] = []
    while len(ents) < docs:
        ent = _entity(etypes[len(ents) % len(etypes)], rng)
        if ent["name"] not in [e["name"] for e in ents]:
            ents.append(ent)
    ctxs = []
    for ent in ents:
        kinds = list(ent["facts"])
        rng.shuffle(kinds)
        sentences = [_cap(rng.choice(DOC_TEMPLATES[k]).format(**_slots(ent, k))) for k in kinds]
        sentences += [_event(ent, rng) for _ in range(events)]
        rng.shuffle(sentences)
        ctxs.append({"title": ent["name"], "text": " ".join(sentences)})
    order = list(range(docs))
    rng.shuffle(order)
    asked = []
    for j in range(questions):
        ent = ents[j % docs]
        kind = next(k for k in KINDS[j % len(KINDS):] + KINDS[: j % len(KINDS)] if k in ent["facts"])
        qrng = random.Random(f"kvrag.synthetic:{key}:{j}:question:{phrasings}")
        asked.append({"question": _cap(qrng.choice(templates(kind, phrasings)).format(**_slots(ent, kind))),
                      "answers": ent["facts"][kind][2], "kind": kind, "gold_index": order.index(j % docs)})
    return {"id": key, "ctxs": [ctxs[i] for i in order], "questions": asked}


def calibration_set() -> dict[str, Any]:
    """The calibration set: CALIBRATION_GROUPS contexts of each size, CALIBRATION_QUESTIONS questions each."""
    groups = [{**mixed_group(f"{CALIBRATION_KEY}:{size}:{g}", docs, CALIBRATION_QUESTIONS), "size": size}
              for g in range(CALIBRATION_GROUPS) for size, docs in CALIBRATION_SIZES]
    return {"source": "kvrag.eval.synthetic.calibration_set", "groups": groups}


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """One JSON row per line, written to a temporary file then renamed, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a data file should read like any other
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0, help="training 0-99, evaluation >= 1000 (convention)")
    ap.add_argument("--style", choices=STYLES, default="short")
    ap.add_argument("--docs", type=int, default=3, help="documents per row, the gold one included")
    ap.add_argument("--phrasings", choices=PHRASINGS, default="all")
    ap.add_argument("--out", required=True)
    ap.add_argument("--calibration", action="store_true", help="write the calibration set (JSON) instead: kvrag/check/calibration_set.json")
    args = ap.parse_args(argv)
    if args.calibration:
        Path(args.out).write_text(json.dumps(calibration_set(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote the calibration set to {args.out}", file=sys.stderr)
        return 0
    out = write_jsonl(rows(args.n, args.seed, args.style, args.docs, args.phrasings), args.out)
    print(f"wrote {args.n} rows to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
