"""Make the small example files the README's and the documentation's commands read (run from the repository root:
python examples/make.py). Every file is written from the texts below, so the examples are
the same on every machine."""
import bz2
import gzip
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

NOTES = """Notes on training a small model on a laptop.

A training step reads a batch of windows of text, runs the model forward, measures how badly
it predicted each next character, and walks the same path backward to find how every weight
should move. The optimizer then moves them a little. Nothing else happens, thousands of times.

Keep the first runs short. A model of four layers and a context of one hundred and twenty
eight characters learns the shape of words in a few hundred steps and the shape of sentences
in a few thousand. Watch the validation loss, not the training loss: the first says what the
model has learned, the second what it has memorised.

When the loss stops falling, lower the learning rate or stop. When it rises, the step was too
large or the data ran out. When it is a number that is not a number, something overflowed:
the last good checkpoint is still on disk.

A checkpoint is a folder: the weights, the optimizer's moments, the tokenizer, the config and
the log of every step. Copy the folder and you have copied the run. Resume it and it goes on
exactly as if it had never stopped.

Attention is a weighted average. Each position asks a question, every earlier position
offers a key, and the answer is the mix of their values that the match of question and key
decides. The weights of the mix sum to one, which is why a softmax sits in the middle, and why
its gradient is the one piece of the backward pass that needs care.

Layer normalisation rescales each position to mean zero and unit variance, then lets the
model choose its own scale and shift. Its backward removes two means from the incoming
gradient: the part that would shift every channel at once, and the part along the position
itself. Forget either and the check against finite differences fails at once.

The residual stream is the sum that runs through the whole model. Every block reads it, adds
what it has to say, and passes it on. The gradient flows back along the same sum unchanged,
which is what lets a deep stack train at all.

Fine-tuning starts from weights that already know the language and teaches them a little
more. With adapters only two thin matrices per layer learn; the rest stays frozen, and the
saved run is small enough to mail. Merge the adapters back and the model is plain again.

Sampling turns the model's scores into text. A temperature below one sharpens the choice,
above one flattens it; top k and top p cut away the unlikely tail. With a fixed seed the same
prompt gives the same text, which makes a comparison between two settings fair.

Evaluate on text the model has never seen. A loss measured on the training text rewards
memory; a loss measured on held out text rewards understanding, which is the point.
"""

THINGS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow",
          "rose": "red", "sea": "blue", "night": "dark"}
SYSTEMS = {"Reply in upper case.": str.upper, "Reply in lower case.": str.lower}


def dialogue(rng: random.Random, turns: int) -> dict:
    system = rng.choice(list(SYSTEMS))
    style = SYSTEMS[system]
    messages = [{"role": "system", "content": system}]
    for _ in range(turns):
        thing = rng.choice(list(THINGS))
        messages.append({"role": "user", "content": f"What colour is the {thing}?"})
        messages.append({"role": "assistant", "content": style(f"The {thing} is {THINGS[thing]}.")})
    return {"messages": messages}


def main() -> None:
    (HERE / "notes.txt").write_text(NOTES, encoding="utf-8")
    rng = random.Random(0)
    with open(HERE / "dialogues.jsonl", "w", encoding="utf-8") as f:
        for _ in range(400):
            f.write(json.dumps(dialogue(rng, rng.randint(1, 3))) + "\n")
    with open(HERE / "held-out.jsonl", "w", encoding="utf-8") as f:         # user turns to answer
        for thing in ("grass", "coal", "rose"):
            f.write(json.dumps({"messages": [{"role": "system", "content": "Reply in upper case."},
                                             {"role": "user", "content": f"What colour is the {thing}?"}]}) + "\n")
    paragraphs = [p for p in NOTES.split("\n\n") if p.strip()]
    shards = HERE / "shards"
    shards.mkdir(exist_ok=True)
    (shards / "part-0.txt").write_text("\n\n".join(paragraphs[:3]) + "\n", encoding="utf-8")
    with gzip.open(shards / "part-1.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n\n".join(paragraphs[3:]) + "\n")
    with bz2.open(HERE / "corpus.txt.bz2", "wt", encoding="utf-8") as f:
        f.write(NOTES * 4)
    with gzip.open(HERE / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        for i, p in enumerate(paragraphs * 3):
            f.write(json.dumps({"id": i, "body": p}) + "\n")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:                     # the parquet extra: pip install 'tbp[parquet]'
        return
    pq.write_table(pa.table({"text": paragraphs * 3}), HERE / "train-00000.parquet")


if __name__ == "__main__":
    main()
