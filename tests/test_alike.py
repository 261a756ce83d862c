"""Records of one kind (kvrag.methods.alike): a shared pattern, not copied text, not unrelated passages."""

from kvrag.methods.alike import records_of_one_kind, shared_share

RIVERS = [
    f"The {n} River has {c} water. The length of the {n} River is {km} km. It was in {y} that the {n} River was first "
    f"mapped. The first explorer of the {n} River was {who}. The {n} River is located in the region of {r}."
    for n, c, km, y, who, r in [
        ("Wenenwen", "yellow", 789, 1893, "Mararic Keleldra", "Rosanesk"),
        ("Wenardra", "brown", 307, 1872, "Garorin Ulvomar", "Keloennia"),
        ("Faloven", "green", 763, 1601, "Kelivra Daloost", "Quararorra"),
        ("Marorsk", "black", 159, 1755, "Corivra Eryidun", "Braaravia"),
    ]
]
PASSAGES = [
    "Volcanoes erupt lava, ash and gas from deep below the crust when pressure builds in a magma chamber.",
    "The central bank raised interest rates on Tuesday, and stock markets fell in early trading.",
    "A cat sat on the mat and purred all afternoon while rain fell against the kitchen window.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside chloroplasts.",
]
BOOK = ("It was a bright cold day in April and the clocks were striking thirteen while the wind swept dust along "
        "the street and a man hurried home through the glass doors of the building where he lived on the seventh floor")


def _windows(text: str, size: int = 24, step: int = 6) -> list[str]:
    words = text.split()
    return [" ".join(words[i : i + size]) for i in range(0, len(words) - size + 1, step)]


def test_records_written_to_one_pattern_are_of_one_kind():
    assert shared_share(RIVERS, 3) >= 0.15 and shared_share(RIVERS, 8) < 0.25
    assert records_of_one_kind(RIVERS)


def test_unrelated_passages_are_not():
    assert shared_share(PASSAGES, 3) < 0.15
    assert not records_of_one_kind(PASSAGES)


def test_overlapping_windows_of_one_text_are_copies_not_records():
    windows = _windows(BOOK)
    assert len(windows) >= 2 and shared_share(windows, 8) >= 0.25
    assert not records_of_one_kind(windows)


def test_too_few_chunks_to_compare():
    assert not records_of_one_kind(RIVERS[:1]) and not records_of_one_kind([])
    assert not records_of_one_kind(["", ""])


def test_the_question_names_its_record_by_its_rarest_words():
    from kvrag.methods.alike import named_by

    scores = named_by("How long is the Faloven River?", RIVERS)
    assert max(range(len(RIVERS)), key=scores.__getitem__) == 2
    assert named_by("What colour is the water?", RIVERS) == [0.0] * len(RIVERS)  # words every record holds count for none
