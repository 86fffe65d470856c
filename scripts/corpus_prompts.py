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
* ``ifbench.jsonl``: all 294 IFBench instruction prompts (``corpora/*/ifbench`` holds the answers to the first 96).

Held out from every corpus: ShareGPT entries 10,000 and later, GSM8K test 1,000 and later, HumanEval, MT-Bench.
"""

import json
import re
import sys
from pathlib import Path

DATASETS = Path.home() / ".cache" / "dflash-hf" / "datasets"
SHAREGPT_USED = 1728  # prompts of sharegpt.jsonl answered in the ShareGPT corpus when the code corpus began
CODE_WORDS = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|sql|html|css|react|node|function|code|script|regex|bash|api|"
    r"json|class|golang|rust|php|django|flask|pandas|numpy)\b|```|def |import ",
    re.IGNORECASE,
)


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
    gsm8k = read("gsm8k.jsonl")[:1000]
    assert gsm8k[-1]["id"] == "gsm8k/999", "prepare's gsm8k.jsonl is GSM8K test in order"
    write(out / "gsm8k.jsonl", gsm8k)
    write(out / "ifbench.jsonl", read("ifbench.jsonl"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/corpus_prompts.py OUT_DIR")
    main(Path(sys.argv[1]))
