"""`tbp generate`: stream text from a checkpoint."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

from ..data import prepare
from ..files import jsonio
from ..machine import memory
from ..errors import TbpError
from ..generate.sampling import Sampling, Stats, generate_text
from .common import console, fmt_bytes, the_run, load_run
from ..data.tokenizer import END
from .speculation import speculation_options
from .options import FiniteFloat, check_strategy, stop_strings, strategy_name, strategy_options, strategy_record


def _prompt_text(prompt, prompt_file) -> tuple[str, bool]:
    """(the prompt, whether it came from a file or stdin: text whose last newline ends the
    file rather than belongs to the prompt)."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give --prompt or --prompt-file, not both")
    if prompt is not None:
        return prompt, False
    if prompt_file is not None:
        return prepare.read_file(prompt_file, what="prompt file")[0], True
    if not sys.stdin.isatty():
        return prepare.read_file("-")[0], True
    return "", False


def read_prompts(path: str) -> list[str]:
    """The prompts of --prompts FILE ('-': stdin): JSON lines (each a string, or an object with a
    string "prompt"), when the file is .jsonl or its first line is JSON; else one per line. Blank
    lines are skipped; a bad line is named file:line."""
    return [text for _, text in read_prompts_at(path)[1]]


def read_prompts_at(path: str) -> tuple[str, list[tuple[int, str]]]:
    """(how the file is named, [(line number, prompt)]): :func:`read_prompts` with each prompt's line."""
    text, where, _ = prepare.read_file(path, what="file of prompts")
    numbered = [(n, line) for n, line in jsonio.lines(text) if line.strip()]
    if not numbered:
        raise TbpError(f"{where}: no prompts (one a line, or JSON lines)")
    as_json = where.endswith((".jsonl", ".ndjson"))
    if not as_json and numbered[0][1].lstrip().startswith(("{", '"')):
        try:                                  # JSON lines in a .txt file; else a prompt that opens with a quote
            jsonio.parse(numbered[0][1], f"{where}:{numbered[0][0]}")
            as_json = True
        except TbpError:
            pass
    if not as_json:
        return where, numbered
    out = []
    for n, line in numbered:
        value = jsonio.parse(line, f"{where}:{n}")
        if isinstance(value, dict):
            value = value.get("prompt")
        if not isinstance(value, str):
            raise TbpError(f"{where}:{n}: expected a JSON string or an object with a string \"prompt\"")
        out.append((n, value))
    return where, out


def _one_line_end_off(text: str) -> str:
    """``echo 12345 | tbp generate`` on a run that completes sources: the source is 12345."""
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def source_tokens(tok, text: str, n_ctx: int, seq2seq: bool) -> tuple[list[int], str]:
    """A source to complete: an encoder-decoder's encoder input, or a GPT's prompt ending in
    <|sep|>, as the pairs it trained on were laid out. Never cropped: a cut source is another."""
    if not text:
        raise TbpError("this model completes a source: give one with --prompt (or on stdin)")
    if tok.sep_id is None:
        raise TbpError("this run's tokenizer has no <|sep|> token, so it was not trained on pairs")
    limit = n_ctx if seq2seq else n_ctx - 1
    if tok.min_tokens(text) > limit:        # refused before the library spends memory on it
        raise TbpError(f"the source has at least {tok.min_tokens(text)} tokens; this model reads at most {limit}")
    ids = tok.encode(text, "prompt")
    ids = ids if seq2seq else ids + [tok.sep_id]
    if len(ids) > limit:
        raise TbpError(f"the source has {len(ids)} tokens; this model reads at most {limit}")
    return ids, ""


def start_tokens(tok, text: str, n_ctx: int | None = None) -> tuple[list[int], str]:
    """Prompt ids; an empty prompt starts from <|endoftext|> or, for a char tokenizer, a newline.
    Of a prompt far longer than the context ``n_ctx`` only its tail is encoded (from a space
    well before the last ``n_ctx`` tokens can begin): the model keeps the last ``n_ctx`` anyway."""
    if text:
        tok.check(text, "prompt")
        note = ""
        if n_ctx is not None and tok.min_tokens(text) > 4 * n_ctx:
            start = len(text) - 2 * n_ctx * tok.max_token_chars
            space = text.rfind(" ", max(0, start - 64), start)      # a word's start just before, if near
            tail = text[space if space >= 0 else start:]
            note = f"prompt of {len(text):,} characters: encoding its last {len(tail):,}"
            text = tail
        return tok.encode(text, "prompt"), note
    if tok.eot_id is not None:
        return [tok.eot_id], "starting from <|endoftext|>"
    if "\n" in tok.hf.get_vocab():
        return tok.encode("\n"), "no prompt: starting from a newline"
    raise TbpError("empty prompt: this tokenizer has no start token and no newline; give --prompt")


@click.command()
@click.option("--checkpoint", "run", type=click.Path(path_type=Path), default=None,
              help="Run directory. Default: TBP_CHECKPOINT, else the newest text or pairs run under checkpoints/ that did not abort (tbp runs).")
@click.option("--prompt", default=None, help="Text to continue. Default: stdin when piped, else none.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the prompt from a file (one prompt, any number of lines).")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE",
              help="Many prompts: one per line, or JSON lines (strings, or objects with \"prompt\"); '-' for "
                   "stdin. Each is sampled in turn, prompt i with seed --seed + i; as text, each prompt's "
                   "samples follow a line '=== prompt i ==='.")
@click.option("--json", "as_json", is_flag=True,
              help="JSON lines on stdout: one record per sample, with its prompt, settings and seed.")
@click.option("--logprobs", type=click.IntRange(0, 20), default=None, metavar="N",
              help="With --json: each token's log-probability under the model (the log-softmax of its logits, "
                   "whatever the sampling settings) and its N likeliest alternatives'.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--temperature", type=FiniteFloat(min=0), default=0.8, show_default=True,
              help="Softmax temperature; 0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="Sample from the k most likely tokens only.")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=None,
              help="Nucleus sampling: the smallest set with mass p.")
@click.option("--min-p", type=FiniteFloat(0, 1), default=None,
              help="Only tokens at least p times as likely as the likeliest (llama.cpp's min-p, before the "
                   "temperature).")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Make the sampling repeatable.")
@click.option("--num-samples", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Independent samples, decoded together as one batch.")
@click.option("--stop", multiple=True, callback=stop_strings,
              help=r"End a sample at this string (repeatable); \n, \t and \\ stand for a newline, a tab "
                   r"and a backslash.")
@click.option("--kv-cache/--no-kv-cache", default=True, show_default=True,
              help="--no-kv-cache recomputes every token's full window: the slow baseline.")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Print text as it is generated (one sample only).")
@click.option("--best", is_flag=True, help="Use the weights with the best validation loss.")
@strategy_options("sample")
@speculation_options
def generate(run, prompt, prompt_file, prompts_file, as_json, logprobs, max_new_tokens, temperature, top_k, top_p,
             min_p, seed, num_samples, stop, kv_cache, stream, best, strategy=None, speculation=None):
    """Sample text from a trained model, streamed to stdout, with a KV cache.

    Each new token attends once to the cached keys and values of the tokens before it, so
    the cost per token grows linearly with the text, not quadratically. A prompt longer
    than the context keeps its last tokens (with a warning); past the context, the cache is
    refilled from the most recent half window. stdout carries only the generated text.

    A run trained on pairs (an encoder-decoder, or a GPT on a pairs dataset) completes the
    prompt as a source: it prints the target alone, ending at <|endoftext|>. An
    encoder-decoder encodes the source once and computes each layer's cross-attention keys
    and values once; each target token is then one cached step.

    \b
    Examples:
      tbp generate
      tbp generate --checkpoint checkpoints/shakespeare --prompt "ROMEO:" --temperature 0.7 --top-k 40
      echo "def main():" | tbp generate --stop "\\n\\n" --seed 1
      tbp generate --checkpoint checkpoints/reverse --prompt 12345 --temperature 0
      tbp generate --prompts prompts.txt --max-new-tokens 100 --seed 0 --json > samples.jsonl
      tbp generate --prompt-file code.py --lookup --temperature 0     # speculative: drafts copied from the prompt
    """
    sampling = Sampling(temperature, top_k, top_p, min_p=min_p)
    if strategy is not None and not kv_cache:
        raise click.UsageError(f"--{strategy_name(strategy)} decodes from the KV cache: it cannot run with "
                               f"--no-kv-cache")
    if speculation is not None:
        how = "--lookup" if speculation.lookup else "--draft"
        for bad, why in ((num_samples > 1, "--num-samples above 1"), (not kv_cache, "--no-kv-cache"),
                         (strategy is not None, f"--{strategy_name(strategy)}" if strategy is not None else "")):
            if bad:
                raise click.UsageError(f"{how} decodes one sample from the KV cache, densely: it cannot run with {why}")
    if prompts_file is not None and (prompt is not None or prompt_file is not None):
        raise click.UsageError("give --prompts, or --prompt / --prompt-file, not both")
    if logprobs is not None and not as_json:
        raise click.UsageError("--logprobs writes into --json's records: give --json with it")
    if seed is None and as_json:              # a record names the seed that makes it again
        seed = int(np.random.default_rng().integers(1 << 31))
    run = the_run(run, ("text", "pairs"))
    where, numbered = read_prompts_at(prompts_file) if prompts_file is not None else (None, [])
    texts = [(t, False) for _, t in numbered] if prompts_file is not None \
        else [_prompt_text(prompt, prompt_file)]
    model, tok, cfg = load_run(run, best=best)    # checks shapes and the weights' memory
    # a run trained on pairs completes a source: the output is the target alone
    seq2seq = model.reads_source
    completes = seq2seq or cfg.get("data_kind") == "pairs"
    for n, text in numbered:                  # every prompt of a file encodes, or none is sampled
        try:
            source_tokens(tok, text, model.config.n_ctx, seq2seq) if completes else start_tokens(tok, text)
        except (TbpError, click.BadParameter) as e:
            what = e.message if isinstance(e, click.BadParameter) else str(e)
            raise TbpError(f"{where}:{n}: {what.removeprefix('prompt: ')}") from None
    if strategy is not None:
        check_strategy(model.config, strategy)
    drafter = speculation.drafter(model, tok, run) if speculation is not None else None
    memory.check_fits(memory.decoder_bytes(model.config, num_samples, model.dtype),
                      f"sampling {num_samples} sequence(s) from {run}")
    if cfg.get("data_kind") == "chat":             # a reply ends at the end-of-message marker
        stop = tuple(stop) + (END,)
        console.print(f"[dim]a chat model: each sample ends at {END}; tbp chat --checkpoint {run} holds a "
                      f"conversation[/]")
    settings = {"run": str(run), "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                "max_new_tokens": max_new_tokens, "stop": list(stop), "kv_cache": kv_cache,
                **strategy_record(strategy), **({"speculation": drafter.describe()} if drafter else {})}
    for k, (text, streamed) in enumerate(texts):
        if len(texts) > 1 and not as_json:
            sys.stdout.write(f"=== prompt {k + 1} ===\n")
        seed_k = None if seed is None else seed + k
        stream_k = stream and num_samples == 1 and not as_json and len(texts) == 1
        stats = Stats()
        completions, prompt_shown = _sample(model, tok, text, streamed, completes, seq2seq, sampling, seed_k,
                                            num_samples, max_new_tokens, kv_cache, tuple(stop), strategy, stream_k, run,
                                            stats, drafter, logprobs)
        if as_json:
            counts = {"speculative": stats.tally.record()} if stats.tally is not None else {}
            for i, completion in enumerate(completions):
                lps = {"logprobs": [{"token": tok.decode([t]), "logprob": lp,
                                     "top_logprobs": [{"token": tok.decode([a]), "logprob": x} for a, x in top]}
                                    for t, lp, top in stats.logprobs[i]]} if logprobs is not None else {}
                sys.stdout.write(json.dumps({"prompt": text, "prompt_index": k, "sample": i, "seed": seed_k,
                                             "completion": completion, **settings, **counts, **lps}) + "\n")
        elif not stream_k:
            for i, completion in enumerate(completions):
                if num_samples > 1:
                    sys.stdout.write(f"--- sample {i + 1} ---\n")
                sys.stdout.write(prompt_shown + completion + "\n")
        sys.stdout.flush()


def _sample(model, tok, text, streamed, completes, seq2seq, sampling, seed, num_samples, max_new_tokens, kv_cache,
            stop, strategy, streaming, run, stats, drafter, logprobs=None) -> tuple[list[str], str]:
    """One prompt's samples: (each sample's completion, the prompt text the output shows before
    it). Streams to stdout as it goes when ``streaming``; prints the stats line on stderr."""
    n_ctx = model.config.n_ctx
    if completes:
        ids, note = source_tokens(tok, _one_line_end_off(text) if streamed else text, n_ctx, seq2seq)
        # a target never holds these: the training data had none (and the pad carried no loss)
        sampling.banned = tuple(i for i in (tok.sep_id, tok.pad_id) if i is not None)
        text = ""                          # stdout carries the completion alone
    else:
        ids, note = start_tokens(tok, text, n_ctx)
    if len(ids) > n_ctx:
        console.print(f"[yellow]warning:[/] prompt has {len(ids)} tokens; keeping the last {n_ctx} (the context)")
        ids = ids[-n_ctx:]
    if note:
        console.print(f"[dim]{note}[/]")
    rng = np.random.default_rng(seed)
    outputs = [""] * num_samples
    out = sys.stdout
    if streaming:
        out.write(text)
        out.flush()
    for i, piece in generate_text(model, tok, ids, max_new_tokens, sampling, rng, num_samples,
                                  kv_cache, stop, stats, strategy, drafter, logprobs):
        if streaming:
            out.write(piece)
            out.flush()
        outputs[i] += piece
    if streaming:
        out.write("\n")
        out.flush()
    tps = stats.new_tokens / max(stats.decode_s + stats.prefill_s, 1e-9)
    cache = f" · KV cache {fmt_bytes(stats.cache_bytes)}" if kv_cache else " · no KV cache"
    if strategy is not None:
        cache += f" · {strategy.describe()}"
    if stats.tally is not None and stats.tally.forwards:
        cache += f" · {drafter.describe()}: {stats.tally.summary()}"
    # one line in a log too: not wrapped at 80 columns mid-phrase
    console.print(f"[dim]{stats.new_tokens} tokens × {num_samples} sample(s) in "
                  f"{stats.prefill_s + stats.decode_s:.2f}s ({tps:.0f} tokens/s; prompt {stats.prompt_tokens} "
                  f"tokens, prefill {stats.prefill_s * 1e3:.0f} ms){cache} · {run}[/]", soft_wrap=True)
    return outputs, text
