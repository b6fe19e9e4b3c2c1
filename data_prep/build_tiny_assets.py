"""Build the embedded tiny target, its draft LM and their tokenizer from the standard-library corpus.

    python data_prep/build_tiny_assets.py            # writes mtp_train/assets/tiny/{target,draft,README.md,report.json}

Reproducible: a fixed seed, a fixed number of steps, deterministic data order, one thread count
(results are bit-identical for the same torch build, interpreter and stdlib). Steps:

1. corpus: the interpreter's stdlib `.py` files, split by `mtp_train.data.stdlib.split_of`; the tokenizer,
   the target and the draft see only the "target-train" split;
2. a byte-level BPE tokenizer (8192 entries) with a Llama-3-style chat template that marks assistant
   content with `{% generation %}` so assistant-only loss masks can be read off the template;
3. the training stream: every target-train file as a document, plus one chat sample per documented
   function (user: signature + docstring, assistant: the function), so the target also speaks the chat
   format; packed into fixed windows;
4. the target (`LlamaForCausalLM`, 4 layers, hidden 256, 4 query / 2 KV heads) and the draft (2 layers,
   hidden 128, tied embeddings), trained in fp32 with AdamW and a cosine schedule, stored in bf16;
5. held-out loss and top-1 accuracy on the validation files, beside a unigram baseline, reloaded from
   the saved files (so the figures are those of what ships), written to README.md and report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtp_train.data import stdlib  # noqa: E402
from mtp_train.lm_eval import next_token_metrics, unigram_metrics, windows  # noqa: E402

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
HEADER_START, HEADER_END, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, HEADER_START, HEADER_END, EOT]

# Llama-3 layout. `{% generation %}` marks exactly the tokens an assistant-only loss trains on: the
# assistant's content and the end-of-turn token after it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

TARGET_ARCH = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False)
DRAFT_ARCH = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)


# Llama 3's pre-tokenizer split: runs of newlines are one piece whatever follows them, so a prompt that
# ends in "\n\n" (the generation prompt) tokenizes as a prefix of the conversation that continues it.
# (GPT-2's split gives "\n\n" one token at the end of a string but two before a word.)
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[HEADER_START, HEADER_END, EOT],
                                   model_max_length=1024, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def training_stream(tokenizer, texts: list[str], seed: int) -> tuple[torch.Tensor, dict]:
    """Documents and chat samples, shuffled deterministically and concatenated into one token stream."""
    docs = [tokenizer(t + EOS, add_special_tokens=True)["input_ids"] for t in texts]
    chats = []
    for t in texts:
        for conv in stdlib.function_conversations(t):
            chats.append(tokenizer.apply_chat_template(conv, tokenize=True, return_dict=False))
    items = docs + chats
    random.Random(seed).shuffle(items)
    ids = torch.tensor([i for item in items for i in item], dtype=torch.int32)
    return ids, {"documents": len(docs), "chat_samples": len(chats), "tokens": ids.numel(),
                 "chat_tokens": sum(len(c) for c in chats)}


def validation_windows(tokenizer, seq_len: int) -> torch.Tensor:
    texts = list(stdlib.iter_texts("validation"))
    ids = [i for t in texts for i in tokenizer(t + EOS)["input_ids"]]
    return windows(ids, seq_len)


def train_lm(model: LlamaForCausalLM, stream: torch.Tensor, *, steps: int, batch_size: int, seq_len: int,
             lr: float, warmup: int, seed: int, label: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    n_windows = (stream.numel() - 1) // seq_len
    model.train()
    t0, last = time.time(), time.time()
    log = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, n_windows, (batch_size,), generator=g) * seq_len
        x = torch.stack([stream[s : s + seq_len] for s in starts.tolist()]).long()
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            now = time.time()
            tok_s = batch_size * seq_len * (50 if step else 1) / max(now - last, 1e-9)
            last = now
            log.append({"step": step, "loss": round(loss.item(), 4), "lr": lr_at(step)})
            print(f"[{label}] step {step:5d}/{steps} loss {loss.item():.3f} lr {lr_at(step):.2e} "
                  f"{tok_s:,.0f} tok/s elapsed {now - t0:,.0f}s", flush=True)
    return {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "warmup": warmup,
            "tokens_seen": steps * batch_size * seq_len, "wall_s": round(time.time() - t0, 1), "log": log}


def save(model: LlamaForCausalLM, tokenizer, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=[tokenizer.eos_token_id, eot_id],
                                               pad_token_id=tokenizer.pad_token_id)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    model.to(torch.float32)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "mtp_train" / "assets" / "tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--target-steps", type=int, default=1100)
    ap.add_argument("--draft-steps", type=int, default=600)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--draft-lr", type=float, default=4e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=None, help="cap on validation windows (default: all)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    texts = list(stdlib.iter_texts("target-train"))
    files = {s: len(stdlib.list_files(s)) for s in stdlib.SPLITS}
    print(f"corpus {stdlib.stdlib_root()}: {files}", flush=True)
    tokenizer = build_tokenizer(texts, args.vocab_size)
    stream, stream_info = training_stream(tokenizer, texts, args.seed)
    print(f"training stream: {stream_info}", flush=True)

    common = dict(vocab_size=len(tokenizer), max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa")
    report = {"seed": args.seed, "python": platform.python_version(), "torch": torch.__version__,
              "threads": args.threads, "corpus_files": files, "vocab_size": len(tokenizer),
              "training_stream": stream_info, "models": {}}
    for name, arch, steps, lr in (("target", TARGET_ARCH, args.target_steps, args.target_lr),
                                  ("draft", DRAFT_ARCH, args.draft_steps, args.draft_lr)):
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(LlamaConfig(**common, **arch))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{name}] {n_params / 1e6:.2f}M parameters", flush=True)
        info = train_lm(model, stream, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=lr,
                        warmup=min(200, steps // 10), seed=args.seed, label=name)
        save(model, tokenizer, out / name)
        report["models"][name] = {"parameters": n_params, "architecture": arch, "training": info}

    # Score what ships: reload from disk (bf16 weights) in fp32.
    tok = AutoTokenizer.from_pretrained(out / "target")
    val = validation_windows(tok, args.seq_len)
    if args.eval_windows:
        val = val[: args.eval_windows]
    report["heldout"] = {"windows": val.shape[0], "seq_len": args.seq_len,
                         "unigram": unigram_metrics(stream, val, len(tok)).as_dict()}
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32)
        report["heldout"][name] = next_token_metrics(model, val).as_dict()
        print(f"[{name}] held-out {report['heldout'][name]}", flush=True)
    report["wall_s"] = round(time.time() - t_start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_readme(out, report, argv if argv is not None else sys.argv[1:])
    print(f"wrote {out} in {report['wall_s']:.0f}s")


def write_readme(out: Path, r: dict, argv: list[str]) -> None:
    h = r["heldout"]
    rows = "\n".join(
        f"| {name} | {h[name]['loss']:.3f} | {h[name]['perplexity']:.1f} | {100 * h[name]['top1']:.1f}% |"
        for name in ("target", "draft", "unigram"))
    models = "\n".join(
        f"| {name} | {m['parameters'] / 1e6:.2f}M | {m['architecture']['num_hidden_layers']} | "
        f"{m['architecture']['hidden_size']} | {m['architecture']['num_attention_heads']}/"
        f"{m['architecture']['num_key_value_heads']} | {'yes' if m['architecture']['tie_word_embeddings'] else 'no'} | "
        f"{m['training']['steps']} | {m['training']['tokens_seen'] / 1e6:.1f}M | {m['training']['wall_s'] / 60:.1f} min |"
        for name, m in r["models"].items())
    cmd = "python data_prep/build_tiny_assets.py" + ("" if not argv else " " + " ".join(argv))
    text = f"""# The embedded tiny target

A small Llama-architecture target (`target/`) and draft LM (`draft/`), with their own byte-level BPE
tokenizer ({r['vocab_size']} entries, Llama 3's pre-tokenizer split, so that a prompt ending in the
generation prompt tokenizes as a prefix of the conversation that continues it) and a Llama-3-style chat
template with `{{% generation %}}` markers, trained on the Python standard
library's source (the interpreter's own `.py` files). They make the whole pipeline runnable offline, in
minutes, on a CPU. Both load with `AutoModelForCausalLM.from_pretrained(path)` /
`AutoTokenizer.from_pretrained(path)`; the weights are stored in bf16 (load with `dtype=torch.float32`
on a CPU).

Made by one command, with a fixed seed (this file and `report.json` are written by it):

    {cmd}

The same command with the same torch build, thread count and standard library gives bit-identical files
(two short builds, 20 steps each, gave the same sha256 for every weight and tokenizer file).

## Data

The split rule lives in `mtp_train/data/stdlib.py` (`split_of`): a file's bucket is
`sha256(relative path) % 100`; below 80 is *target-train*, below 90 *head-train*, the rest *validation*.
Files per split here: {', '.join(f'{n} {k}' for k, n in r['corpus_files'].items())}. The tokenizer, the target and the draft are trained on
target-train only ({r['training_stream']['documents']} files as documents plus
{r['training_stream']['chat_samples']} chat samples cut from them: user = a documented function's
signature and docstring, assistant = the function); {r['training_stream']['tokens'] / 1e6:.2f}M tokens
in all. Validation files are never trained on by the target, the draft or any head.

## Models

| model | parameters | layers | hidden | heads q/kv | tied embeddings | steps | tokens seen | wall time |
|---|---|---|---|---|---|---|---|---|
{models}

Trained in fp32 on {r['threads']} CPU threads (Python {r['python']}, torch {r['torch']}), AdamW
(β = 0.9/0.95, weight decay 0.1), linear warm-up then cosine decay to 10%, batches of
{r['models']['target']['training']['batch_size']} × {r['models']['target']['training']['seq_len']} tokens.

## Held-out figures

Next-token loss (nats) and top-1 accuracy on every validation file ({h['windows']} windows of
{h['seq_len']} tokens, {h['target']['tokens']:,} scored positions), measured on the saved (bf16) weights
loaded in fp32. The unigram baseline predicts every position from token frequencies counted on the
training stream (add-one smoothed); its top-1 always guesses the most frequent token.

| model | loss | perplexity | top-1 |
|---|---|---|---|
{rows}

Whole build: {r['wall_s'] / 60:.1f} minutes.
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
