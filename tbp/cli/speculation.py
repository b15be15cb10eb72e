"""The speculative-decoding options of tbp generate, chat and serve (tbp/generate/speculative.py):
--lookup or --draft RUN, with --lookup-ngram and --draft-tokens; checked before anything decodes."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import click

from ..errors import TbpError
from ..generate import speculative
from ..runs import disk

DRAFT_TOKENS = {"lookup": 8, "draft": 4}       # the most tokens one step drafts, unless told


@dataclass
class Speculation:
    """What the user asked for: prompt lookup or a draft run, and its sizes."""
    lookup: bool
    draft: Path | None
    ngram: int
    tokens: int

    def drafter(self, model, tok, run) -> "speculative.Lookup | speculative.Draft":
        """The drafter for ``model`` (of run ``run``, tokenizer ``tok``): one line naming both
        models if the draft cannot serve it (TbpError, exit 1)."""
        why = speculative.refusal(model.config)
        if why is not None:
            raise TbpError(f"{run}: cannot decode speculatively: {why}")
        if self.lookup:
            return speculative.Lookup(self.ngram, self.tokens)
        draft_model, draft_tok, _ = disk.load_model(self.draft)
        if draft_tok.to_str() != tok.to_str():
            raise TbpError(f"--draft {self.draft} cannot draft for {run}: their tokenizers differ "
                           f"(a draft must cut text into the same tokens)")
        why = speculative.check_draft(model, draft_model, str(run), f"--draft {self.draft}")
        if why is not None:
            raise TbpError(why)
        return speculative.Draft(draft_model, self.tokens, label=str(self.draft))


def speculation_options(fn):
    """Add --lookup, --lookup-ngram, --draft and --draft-tokens, and hand the command
    ``speculation=``: a Speculation, or None when neither --lookup nor --draft is given (a size
    given without them is a usage error)."""
    @functools.wraps(fn)
    def command(*args, lookup, lookup_ngram, draft, draft_tokens, **kw):
        if lookup and draft is not None:
            raise click.UsageError("give --lookup or --draft, not both")
        if not lookup and draft is None:
            for name, value in (("--lookup-ngram", lookup_ngram), ("--draft-tokens", draft_tokens)):
                if value is not None:
                    raise click.UsageError(f"{name} sizes speculative decoding: give --lookup or --draft with it")
            return fn(*args, speculation=None, **kw)
        if draft is None and lookup_ngram is None:
            lookup_ngram = 3
        if draft is not None and lookup_ngram is not None:
            raise click.UsageError("--lookup-ngram sizes prompt lookup (--lookup), not a draft model")
        tokens = draft_tokens or DRAFT_TOKENS["lookup" if lookup else "draft"]
        return fn(*args, speculation=Speculation(lookup, draft, lookup_ngram or 0, tokens), **kw)
    for option in reversed([
        click.option("--lookup", is_flag=True,
                     help="Speculative decoding by prompt lookup: draft the tokens that followed the last "
                          "occurrence of the text's final n-gram, check them in one forward; the output has "
                          "the model's law exactly. Pays where the answer copies from the prompt."),
        click.option("--lookup-ngram", type=click.IntRange(1, 16), default=None, metavar="N",
                     help="The longest n-gram --lookup matches (then shorter, down to 2).  [default: 3]"),
        click.option("--draft", type=click.Path(path_type=Path), default=None, metavar="RUN",
                     help="Speculative decoding with a smaller run of the same tokenizer and context as the "
                          "draft model; the output has the model's law exactly."),
        click.option("--draft-tokens", type=click.IntRange(1, 64), default=None, metavar="K",
                     help="The most tokens drafted a step (fewer after a rejection).  [default: 8 with "
                          "--lookup, 4 with --draft]"),
    ]):
        command = option(command)
    return command
