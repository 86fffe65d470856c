"""scripts/corpus_prompts.py: the code-completion prompts keep a function's signature and docstring, never its body."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("corpus_prompts", REPO / "scripts" / "corpus_prompts.py")
corpus_prompts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_prompts)

DOC = "Add two numbers and give back their sum, which is what this docstring says at some length."

MODULE = f'''import functools


def add(a,
        b=2):
    """{DOC}"""
    total = a + b
    return total


@functools.cache
def cached(x):
    """{DOC}
    >>> cached(1)
    1
    """
    return x


def _private(x):
    """{DOC}"""
    return x


def short(x):
    """Too short."""
    return x


class Box:
    def method(self):
        """{DOC}"""
        return self
'''


def write_package(root: Path) -> Path:
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "tools.py").write_text(MODULE)
    (root / "pkg" / "tests" / "test_tools.py").write_text(MODULE)  # test folders are left out
    (root / "pkg" / "broken.py").write_text("def broken(:\n")  # a file that does not parse is skipped
    return root / "pkg"


def test_completion_functions_keep_signature_and_docstring_and_drop_the_body(tmp_path):
    found = corpus_prompts.completion_functions("pkg", write_package(tmp_path))
    heads = {name: head for _, name, head in found}
    assert sorted(heads) == ["add", "cached"]  # public, module level, a docstring of 60-1,200 characters
    assert heads["add"] == f'def add(a,\n        b=2):\n    """{DOC}"""'  # the whole signature, no body
    assert heads["cached"].startswith("def cached(x):") and heads["cached"].endswith('    1\n    """')
    assert sorted(ident for ident, _, _ in found) == ["pkg/tools:add", "pkg/tools:cached"]


def test_code_completion_prompts_take_the_sources_in_turn_each_name_once(tmp_path, monkeypatch):
    first, second = write_package(tmp_path / "a"), write_package(tmp_path / "b")
    (second / "more.py").write_text(MODULE.replace("def add(", "def plus(").replace("def cached(", "def memo("))
    monkeypatch.setattr(corpus_prompts, "source_root", {"one": first, "two": second}.get)
    taken = set()
    entries = corpus_prompts.code_completion_prompts(("one", "two"), taken)
    names = sorted(entry["id"].rsplit(":", 1)[1] for entry in entries)
    assert names == ["add", "cached", "memo", "plus"]  # add and cached, in both sources, are taken once
    # a second file from the second source alone gets no name the first one used
    assert taken == set(names) and corpus_prompts.code_completion_prompts(("two",), taken) == []
    assert {entry["id"].split("/")[1] for entry in entries[:3]} == {"one", "two"}  # in turn, not one after the other
    prompt = entries[0]["turns"][0]
    assert prompt.startswith("Complete the following Python function:\n```python\ndef ")
    assert prompt.endswith('"""\n```') and "return" not in prompt
    json.dumps(entries)  # a prompt file line


def test_gsm8k_variants_redraw_every_number_in_its_shape_and_keep_0_and_1():
    questions = [{"id": "gsm8k/7", "turns": ["Tom buys 1 hat for $12.50 and 3 shirts; he had $1,250 and 0 debts. "
                                             "On day 2nd he sold 40% of 2 boxes."]},
                 {"id": "gsm8k/8", "turns": ["Ann has two apples and one pear. How many fruits?"]}]
    variants = corpus_prompts.gsm8k_variants(questions, copies=3, seed=0)
    assert [v["id"] for v in variants] == ["gsm8k-variant/7-1", "gsm8k-variant/7-2", "gsm8k-variant/7-3"]
    pattern = (r"Tom buys 1 hat for \$([1-9]\d)\.(\d\d) and ([2-9]) shirts; he had \$([1-9]),(\d{3}) and 0 debts\. "
               r"On day 2nd he sold ([1-9]\d)% of ([2-9]) boxes\.")
    drawn = [re.fullmatch(pattern, v["turns"][0]) for v in variants]
    assert all(drawn), [v["turns"][0] for v in variants]
    assert all(m.group(1) != "12" and m.group(3) != "3" and m.group(6) != "40" and m.group(7) != "2"
               for m in drawn)  # never the original's number
    assert len({v["turns"][0] for v in variants}) == 3
    assert corpus_prompts.gsm8k_variants(questions, copies=3, seed=0) == variants  # seeded


def test_composed_requests_pair_every_form_with_every_subject_once_in_a_seeded_order():
    parts = {"forms": ["Write a poem about {subject}.", "Write an email to {audience} about {subject}."],
             "subjects": ["kites", "tea", "rain"], "audiences": ["your manager", "a ten-year-old"],
             "constraints": [" Keep it short."]}
    requests = corpus_prompts.composed_requests(parts, "writing", seed=0)
    assert sorted(r["id"] for r in requests) == [f"writing/{f}-{s}" for f in range(2) for s in range(3)]
    for r in requests:
        form, subject = (int(i) for i in r["id"].removeprefix("writing/").split("-"))
        text = r["turns"][0].removesuffix(" Keep it short.")
        if form == 0:
            assert text == f"Write a poem about {parts['subjects'][subject]}."
        else:
            assert re.fullmatch(rf"Write an email to (your manager|a ten-year-old) about {parts['subjects'][subject]}\.",
                                text), text
    assert corpus_prompts.composed_requests(parts, "writing", seed=0) == requests  # seeded
    assert corpus_prompts.composed_requests(parts, "writing", seed=1) != requests


PARTS_FILES = corpus_prompts.COMPOSED_PARTS


@pytest.mark.parametrize("kind", sorted(PARTS_FILES))
def test_the_shipped_parts_compose_thousands_of_distinct_requests(kind):
    requests = corpus_prompts.composed_requests(json.loads(PARTS_FILES[kind].read_text()), kind)
    texts = [r["turns"][0] for r in requests]
    assert len(texts) == len(set(texts)) >= 2000
    assert not any("{" in t for t in texts)  # every placeholder filled
    assert all(r["id"].startswith(f"{kind}/") for r in requests)
    forms = {r["id"].split("/")[1].split("-")[0] for r in requests[:200]}
    assert len(forms) > 20  # a prefix of the file mixes the forms


def test_the_question_subjects_leave_mt_bench_topics_out():
    """The question requests must not teach the drafter MT-Bench's own STEM and humanities topics (MT-Bench is held
    out): none of the subjects that its questions name is a subject here."""
    subjects = {s.lower() for s in json.loads(PARTS_FILES["questions"].read_text())["subjects"]}
    for named in ("the pythagorean theorem", "probability", "recursion", "the renaissance", "earthquakes",
                  "photosynthesis", "antitrust laws", "machine learning", "the fibonacci sequence"):
        assert named not in subjects


@pytest.mark.parametrize("kind", ["tasks", "roleplay"])
def test_the_task_and_roleplay_requests_leave_mt_bench_writing_and_roleplay_topics_out(kind):
    """The multi-part task and role-play requests are MT-Bench's kind (writing and role-play), so none of the topics
    or roles its first turns name may appear in a form or a subject: they would put held-out answers in the corpus."""
    parts = json.loads(PARTS_FILES[kind].read_text())
    text = " ".join(parts["forms"] + parts["subjects"]).lower()
    for named in ("hawaii", "smartphone", "marketplace", "abandoned house", "time travel", "bio-energy", "mars",
                  "elon musk", "sheldon", "iron man", "doctor", "relationship coach", "translator", "machine learning",
                  "math teacher", "square root", "deforest", "quarterly", "introverted", "guest speaker",
                  "mathematician", "old tree", "stark"):
        assert named not in text, named


def test_gsm8k_train_questions_leave_out_the_default_prompt_and_test_questions(tmp_path):
    from dflash_hf.cli import DEFAULT_PROMPT

    rows = [{"question": DEFAULT_PROMPT, "answer": "#### 72", "idx": 0},
            {"question": "A shop sells 3 pens for $2. How much do 12 pens cost?", "answer": "#### 8", "idx": 1},
            {"question": "Janet has 5 ducks.", "answer": "#### 5", "idx": 2},
            {"question": "Tom reads 4 pages a day. How many pages in a week?", "answer": "#### 28", "idx": 3}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    entries = corpus_prompts.gsm8k_train_questions(path, test_questions={"Janet has 5 ducks."})
    assert entries == [{"id": "gsm8k-train/1", "turns": [rows[1]["question"]]},
                       {"id": "gsm8k-train/3", "turns": [rows[3]["question"]]}]
