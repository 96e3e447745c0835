"""Open-ended chat prompts for drafter training: WordNet nouns × generic instruction templates.

The default drafter's chat data came from `python scripts/wordnet_chat_prompts.py 4000 chat_prompts.jsonl`
(Debian: `apt install wordnet-base`). No evaluation-set text is involved: the concepts are WordNet noun lemmas
seen at least twice in its sense-tagged corpus, the templates are generic requests.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys

COUNTS = "/usr/share/wordnet/cntlist.rev"  # "lemma%1:…  sense  count" lines; 1: is a noun
ONE = ["What is {x}?", "Explain what {x} is to a ten-year-old.", "Write a short paragraph about {x}.",
       "Give three interesting facts about {x}.", "Briefly describe the history of {x}.",
       "What are the advantages and disadvantages of {x}?", "Write a short poem about {x}.",
       "Write a short story that involves {x}.", "How does {x} work?", "Why is {x} important?",
       "List five words related to {x} and explain each one.", "Write a tweet about {x}.",
       "Give me some practical tips related to {x}.", "Write an email to a friend about {x}.",
       "What would happen if there were no {x}?", "Write a product description for something related to {x}.",
       "Describe {x} in a few sentences.", "What are common misconceptions about {x}?",
       "Write a dialogue between two people discussing {x}.", "How would you teach someone about {x}?",
       "Write a haiku about {x}.", "Summarize the most important things to know about {x}.",
       "What questions would a student ask about {x}? Answer them.", "Write a persuasive paragraph about {x}."]
TWO = ["Compare {x} and {y}.", "Explain the difference between {x} and {y}.",
       "Write a short story that involves {x} and {y}.", "How are {x} and {y} related?"]


def nouns(path: str = COUNTS) -> list[str]:
    """Sorted noun lemmas that have a sense tagged at least twice."""
    lemmas = set()
    with open(path) as f:
        for line in f:
            key, _, count = line.split()
            lemma, sense = key.split("%")
            if sense.startswith("1:") and int(count) >= 2 and re.fullmatch(r"[a-z][a-z_\-]{2,30}", lemma):
                lemmas.add(lemma)
    return sorted(lemmas)


def prompts(n: int, seed: int = 0) -> list[dict]:
    """n prompts in prepare's JSONL schema; 15% name two concepts."""
    rng, words = random.Random(seed), nouns()
    out = []
    for i in range(n):
        x, y = (w.replace("_", " ") for w in rng.sample(words, 2))
        template = rng.choice(TWO) if rng.random() < 0.15 else rng.choice(ONE)
        out.append({"id": f"wordnet-chat-{i}", "turns": [template.format(x=x, y=y)]})
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[1].isdigit():
        sys.stderr.write("usage: wordnet_chat_prompts.py N OUT.jsonl  (N: how many prompts)\n")
        sys.exit(2)
    if not os.path.isfile(COUNTS):
        sys.stderr.write(f"{COUNTS} is missing; install WordNet's data (Debian: apt install wordnet-base)\n")
        sys.exit(2)
    with open(sys.argv[2], "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in prompts(int(sys.argv[1])))
